"""The artifact store: what tasks pass each other, where it is kept, and the checks of what is read back.

Artifact references (:mod:`.artifacts`), the store under one root, a local directory or
``s3://bucket/prefix`` (:mod:`.artifact_store`, :mod:`.s3`), and the content checks of stored artifacts
(:mod:`.integrity`).
"""
