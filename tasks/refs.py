"""Artifact references: what tasks pass to each other instead of models, tensors or ad-hoc dicts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ArtifactRef(BaseModel):
    """One stored artifact: where it is, what it is, its content fingerprint and a few small facts.

    ``uri`` is a local path today (the artifact store's, a model directory, an export); ``sha256`` is the
    content fingerprint cache keys are built from; ``meta`` holds small JSON facts (a layer index, a model's
    attention shape, a plan's achieved ratio), never tensors.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str  # "source-model" | "calibration" | "statistic" | "factors" | "summary" | "plan" | "model" | ...
    uri: str
    sha256: str
    meta: dict[str, Any] = {}

    @property
    def path(self) -> str:
        """The local path of the artifact (``uri`` of a local store)."""
        return self.uri
