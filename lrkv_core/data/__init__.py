"""Data: model and dataset references, token streams and windows, held-out splits and percent slices.

References to models and datasets (:mod:`.refs`), reading text and token rows into calibration and evaluation
windows (:mod:`.datasets`), the held-out data of a calibration source (:mod:`.heldout`) and percent slices of
a source (:mod:`.slices`).
"""
