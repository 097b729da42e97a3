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
above are all the cache holds, and :func:`cache_nbytes` measures them. Layers that the model's config
makes sliding-window layers (Mistral, Qwen2's ``layer_types``) keep only the last ``window − 1`` tokens,
exactly as transformers' ``DynamicSlidingWindowLayer`` does for the original model.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs


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


class SlidingLatentLayer(LatentLayer):
    """A latent layer of a sliding-window attention layer: it keeps the last ``window − 1`` tokens.

    Mirrors ``DynamicSlidingWindowLayer``: an update returns the kept tokens plus the new ones (what the
    window mask is built for, see :meth:`get_mask_sizes`), then drops what no later query can see.
    """

    is_sliding = True

    def __init__(self, sliding_window: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sliding_window = int(sliding_window)
        self.cumulative_length = 0

    def update_latents(
        self, h_k: torch.Tensor, h_v: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        keys, values, positions = super().update_latents(h_k, h_v, position_ids)
        self.cumulative_length += h_k.shape[-2]
        start = max(keys.shape[-2] - (self.sliding_window - 1), 0)
        self.keys, self.values = keys[:, start:], values[:, start:]
        if positions is not None:
            self.positions = positions[:, start:]
        return keys, values, positions

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the latents the next update returns, as the window mask expects."""
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        kept = min(self.cumulative_length, self.sliding_window - 1)
        return kept + query_length, kv_offset

    def crop(self, tokens_to_remove: int) -> None:
        if self.cumulative_length >= self.sliding_window:
            raise RuntimeError(
                "cannot crop a sliding-window latent cache layer once its window is full: the tokens "
                "before the window are gone"
            )
        super().crop(tokens_to_remove)
        self.cumulative_length = self.keys.shape[-2] if self.is_initialized else 0

    def activate_past_recording(self) -> None:
        raise NotImplementedError(
            "the latent cache does not record states past the sliding window (needed for assisted decoding)"
        )

    def reset(self) -> None:
        self.cumulative_length = 0
        super().reset()


class LatentCache(DynamicCache):
    """Cache for an lrkv-compressed model: one latent layer per decoder layer.

    Parameters
    ----------
    num_layers : number of decoder layers.
    sliding_windows : per layer, the sliding window (a :class:`SlidingLatentLayer`) or None (every token
        kept); default: no sliding layers. :meth:`from_config` reads them off a model config.
    """

    def __init__(self, num_layers: int, sliding_windows: list[int | None] | None = None) -> None:
        windows = sliding_windows if sliding_windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} sliding windows for {num_layers} layers")
        layers = [LatentLayer() if w is None else SlidingLatentLayer(w) for w in windows]
        Cache.__init__(self, layers=layers)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> LatentCache:
        """The layers transformers' ``DynamicCache(config=...)`` would make, as latent layers."""
        decoder = config.get_text_config(decoder=True)
        types, per_layer = get_layer_types_and_kwargs(decoder)
        sliding = [t == "sliding_attention" for t in types]
        windows = [kw.get("sliding_window") if s else None for s, kw in zip(sliding, per_layer)]
        return cls(decoder.num_hidden_layers, windows)

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
