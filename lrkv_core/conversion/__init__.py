"""The conversion: its config and in-memory API, its step graph, the rank refinement and the budget search.

The config and ``convert()`` (:mod:`.convert`), the one definition of the steps (:mod:`.steps`), path-level
steps that read and write files (:mod:`.pipeline`), refinement of a rank plan on the measured loss
(:mod:`.refine`) and the smallest cache within a quality budget (:mod:`.search`). The methods they call live
beside this package: statistics, decompositions, allocation, cache, quant.
"""
