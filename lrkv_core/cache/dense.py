"""The ``dense`` cache storage: latents kept exactly as computed (Palu's cache, in the model's dtype).

Parts: ``k`` = H_k (B, S, R_k) and ``v`` = H_v (B, S, R_v), all groups side by side; attention reads per-group
views of them (no copy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from .storage import CACHE_STORAGES, CacheStorage, LatentStore, split_groups


class DenseStore(LatentStore):
    """Keeps H_k (B, S, R_k) and H_v (B, S, R_v) as given."""

    def encode(self, h_k: torch.Tensor, h_v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"k": h_k, "v": h_v}

    def decode(self, parts: Mapping[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
        return split_groups(parts["k"], self.ranks_k), split_groups(parts["v"], self.ranks_v)


@CACHE_STORAGES.register
@dataclass(frozen=True)
class DenseStorage(CacheStorage):
    """Latents kept as computed, in the model's dtype."""

    name: ClassVar[str] = "dense"

    def create_store(self, ranks_k: tuple[int, ...], ranks_v: tuple[int, ...]) -> DenseStore:
        return DenseStore(ranks_k, ranks_v)

    def check_static(self) -> None:
        """Every token is kept as given: preallocatable."""
