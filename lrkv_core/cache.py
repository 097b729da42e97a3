"""A transformers ``Cache`` that holds low-rank latents instead of keys and values.

Per layer the cache stores, for every past token,
- ``keys``:      H_k = x A_kᵀ  (B, S, R_k), the key latents of all groups side by side, *before* RoPE;
- ``values``:    H_v = x A_vᵀ  (B, S, R_v), the value latents of all groups side by side;
- ``positions``: (B, S) int32 position ids, so RoPE can be applied to rebuilt keys at any later step
  (left padding gives rows different positions; they come from the cache, never from ``arange``).
  Models without RoPE (OPT) never need them: their attention appends latents without positions and
  the layer holds none, so the cache is latents only.

``LatentCache`` subclasses ``DynamicCache``, so everything ``generate()`` does with a cache (beam
reordering, cropping, batch expansion) goes through the same methods. Memory is real: the tensors
above are all the cache holds, and :func:`cache_nbytes` measures them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class LatentLayer(DynamicLayer):
    """One layer's latent cache: (B, S, R_k) key latents, (B, S, R_v) value latents, (B, S) positions.

    ``positions`` stays None for a layer whose latents come without position ids (non-RoPE models).
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b = key_states.shape[0]
        self.keys = key_states.new_empty((b, 0, key_states.shape[-1]))
        self.values = value_states.new_empty((b, 0, value_states.shape[-1]))
        self.positions = None
        self.is_initialized = True

    def update_latents(
        self, h_k: torch.Tensor, h_v: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append new latents (and their positions, if given); return all cached (H_k, H_v, positions).

        A layer caches positions from its first update on if that update has them, and never otherwise.
        """
        if not self.is_initialized:
            self.lazy_initialization(h_k, h_v)
            if position_ids is not None:
                self.positions = torch.empty((h_k.shape[0], 0), dtype=torch.int32, device=self.device)
        if (position_ids is None) != (self.positions is None):
            raise ValueError(
                f"latent cache layer {'holds' if self.positions is not None else 'has no'} positions; "
                "updates must all come with position ids or all without"
            )
        self.keys = torch.cat([self.keys, h_k], dim=-2)  # (B, S, R_k)
        self.values = torch.cat([self.values, h_v], dim=-2)  # (B, S, R_v)
        if position_ids is not None:
            pos = position_ids.to(device=self.device, dtype=torch.int32).expand(h_k.shape[0], h_k.shape[1])
            self.positions = torch.cat([self.positions, pos], dim=-1)  # (B, S)
        return self.keys, self.values, self.positions

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.positions is not None:
            self.positions = self.positions[..., :tokens_to_remove]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0 and self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0 and self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0 and self.positions is not None:
            self.positions = self.positions[indices, ...]
        super().batch_select_indices(indices)

    def reset(self) -> None:
        self.positions = None
        super().reset()


class LatentCache(DynamicCache):
    """Cache for an lrkv-compressed model: one :class:`LatentLayer` per decoder layer."""

    def __init__(self, num_layers: int) -> None:
        Cache.__init__(self, layers=[LatentLayer() for _ in range(num_layers)])

    def update_latents(
        self, h_k: torch.Tensor, h_v: torch.Tensor, position_ids: torch.Tensor | None, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.layers[layer_idx].update_latents(h_k, h_v, position_ids)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of every tensor a cache holds, over all layers (keys, values, positions, scales, ...)."""
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
