"""A preallocated latent cache, so that a compressed model's decode step can be captured (CUDA graphs,
``torch.compile``) as transformers' ``StaticCache`` allows for the original model.

Every layer allocates, at its first update, buffers for ``max_cache_len`` tokens of whatever its storage keeps
per token (dense latents; a quantized storage's packed codes, scales and zero-points) and the (B, S_max) int32
positions, and writes each update's tokens in place at the next free slots (``index_copy_``), counting them in
a tensor (a sliding layer also in Python). Attention reads all ``max_cache_len`` slots; the causal mask hides
the unwritten ones (the layer announces ``(max_cache_len, 0)`` as the mask's sizes), so nothing about a
step's shapes or addresses changes while the cache fills. A sliding-window layer holds its window only, slot
for slot as transformers' ``StaticSlidingWindowLayer`` holds keys (filled in order, then rolled by one per
decoded token), and announces the same mask sizes.

Only storages that encode each token on its own can be preallocated (:meth:`CacheStorage.check_static`):
``dense``, and ``quantized`` without a full-precision residual window. GEAR and TALE re-encode whole spans
of the cache as it grows, so their stores stay dynamic (:class:`~lrkv_core.cache.LatentCache`).

``generate(..., cache_implementation="static")`` on a compressed model gives it this cache (the model's
forward hook swaps the empty ``StaticCache`` transformers makes for a :class:`StaticLatentCache` of the same
length), so transformers' automatic compilation of decode steps applies to it as to the original.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache
from transformers.utils import is_torchdynamo_compiling

from .latent_cache import LatentUpdates, check_layer_args, layer_args
from .layer import LatentLayerBase, Ranks, _ranks, agreed_ranks
from .storage import CACHE_STORAGES, CacheStorage, LatentStore, LatentView

_POSITIONS = "\x00positions"  # the positions beside the parts while a sliding layer moves its slots


class StaticLatentLayer(LatentLayerBase):
    """One decoder layer's preallocated latent cache.

    Parameters
    ----------
    max_cache_len : tokens the layer can hold.
    storage : a storage that encodes tokens one by one (``dense``, ``quantized`` without residual).
    ranks_k, ranks_v : the layer's per-group ranks; None to learn them from the first update.
    sliding_window : the layer's sliding window, or None.

    Attributes
    ----------
    store : the storage's store, whose parts are the preallocated (B, capacity, ...) buffers.
    capacity : slots per buffer: ``max_cache_len``, or for a sliding layer its window if that is shorter.
    cumulative_length : a 0-d tensor counting the tokens written (the next free slot).
    """

    is_compileable = True
    supports_early_init = False  # buffers are shaped by the storage's parts, known at the first update

    def __init__(
        self,
        max_cache_len: int,
        storage: str | dict | CacheStorage = "dense",
        ranks_k: Sequence[int] | None = None,
        ranks_v: Sequence[int] | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if int(max_cache_len) < 1:
            raise ValueError(f"a static latent cache holds ≥ 1 token, got max_cache_len={max_cache_len}")
        if (ranks_k is None) != (ranks_v is None):
            raise ValueError("give both ranks_k and ranks_v, or neither")
        self.storage = CACHE_STORAGES.create(storage)
        self.storage.check_static()
        self.max_cache_len = int(max_cache_len)
        self.is_sliding = sliding_window is not None
        # slots: a sliding layer holds its window at most (transformers' StaticSlidingWindowLayer's size)
        self.capacity = self.max_cache_len
        if self.is_sliding:
            self.capacity = min(int(sliding_window), self.max_cache_len)
        self.written = 0  # a sliding layer's tokens seen, a Python int: its updates branch on it
        self.ranks: Ranks | None = None if ranks_k is None else _ranks(ranks_k, ranks_v)
        self.store: LatentStore | None = None
        self.cumulative_length = torch.tensor(0, dtype=torch.long)

    def _create_store(self, dtype: torch.dtype, with_positions: bool) -> None:
        """The storage's store for this layer's ranks, decoding to ``dtype``, with positions or without."""
        if self.ranks is None:
            raise ValueError(
                "a static latent cache layer needs its per-group ranks: build the cache with "
                "StaticLatentCache.from_config(model.config, max_cache_len) or ranks_k/ranks_v"
            )
        self.store = self.storage.create_store(*self.ranks)
        self.store.dtype, self.store._with_positions = dtype, with_positions

    def lazy_initialization(self, parts: dict[str, torch.Tensor], positions: torch.Tensor | None) -> None:
        """Allocate (B, capacity, ...) buffers shaped like the first update's encoded ``parts`` and
        ``positions`` (B, T)."""
        first = next(iter(parts.values()))
        self.device, self.batch_size = first.device, first.shape[0]

        def buffer(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((t.shape[0], self.capacity, *t.shape[2:]), dtype=t.dtype, device=t.device)

        self.store.parts = {name: buffer(t) for name, t in parts.items()}
        self.store.positions = None if positions is None else buffer(positions)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():  # fixed addresses: a captured graph reads and writes these
            for t in [*self.store.parts.values(), self.cumulative_length]:
                torch._dynamo.mark_static_address(t)
            if self.store.positions is not None:
                torch._dynamo.mark_static_address(self.store.positions)
        self.is_initialized = True

    def update_latents(
        self,
        h_k: torch.Tensor,
        h_v: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        ranks: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> LatentView:
        """Write new latents h_k (B, T, R_k), h_v (B, T, R_v) (and positions) at the next T slots; return
        the view of all the slots (unwritten ones are zeros, hidden by the mask; a sliding layer:
        :meth:`_slide`)."""
        self.ranks = agreed_ranks(self.ranks, ranks)
        B, T = h_k.shape[:2]
        if self.store is None:
            self._create_store(h_k.dtype, position_ids is not None)
        parts = self.store.encode(h_k, h_v)  # name → (B, T, ...)
        positions = None
        if position_ids is not None:
            positions = position_ids.to(device=h_k.device, dtype=torch.int32).expand(B, T)
        if not self.is_initialized:
            self.lazy_initialization(parts, positions)
        if not is_torchdynamo_compiling():
            self._check_update(B, T, position_ids is not None)
        buffers, new = dict(self.store.parts), dict(parts)  # name → buffer, and the update's tokens
        if positions is not None:
            buffers[_POSITIONS], new[_POSITIONS] = self.store.positions, positions
        if self.is_sliding:
            written, self.written = self.written, self.written + T
            if written + T > self.capacity:
                return self._slide(buffers, new, written)
        slots = torch.arange(T, device=self.device) + self.cumulative_length  # the next free slots
        self.cumulative_length.add_(T)
        for name, t in new.items():
            buffers[name].index_copy_(1, slots, t)
        return self.store.view()

    def _slide(
        self, buffers: dict[str, torch.Tensor], new: dict[str, torch.Tensor], written: int
    ) -> LatentView:
        """A sliding layer's update past its slots (``written`` tokens before it), slot for slot as
        transformers' ``StaticSlidingWindowLayer`` writes keys (so the mask it announces, the same as that
        layer's, reads them right): a full layer rolls its slots left by one per decoded token; a longer
        update (the prefill) is read whole and its last ``capacity`` tokens kept. (Until the slots are full,
        tokens fill them in order, as a full layer's do.)"""
        T, cap = next(iter(new.values())).shape[1], self.capacity
        if written >= cap and T == 1:  # full: the oldest token leaves
            last = torch.tensor([cap - 1], device=self.device)
            for name, t in new.items():
                rolled = buffers[name].roll(-1, dims=1)
                rolled.index_copy_(1, last, t)
                buffers[name].copy_(rolled)  # in place: the buffers keep their addresses
            return self.store.view()
        old = slice(1, cap) if written >= cap else slice(0, written)  # the earlier tokens the update sees
        whole = {name: torch.cat([buffers[name][:, old], t], dim=1) for name, t in new.items()}
        for name, t in whole.items():
            buffers[name].copy_(t[:, -cap:])
        pos = whole.pop(_POSITIONS, None)
        keys, values = self.store.decode(whole)
        return LatentView(tuple(keys), tuple(values), pos)

    def _check_update(self, batch: int, tokens: int, with_positions: bool) -> None:
        if batch != self.batch_size:
            raise ValueError(
                f"a static latent cache of batch {self.batch_size} got an update of batch {batch}"
            )
        if with_positions != self.store._with_positions:
            raise ValueError("updates must all come with position ids or all without")
        if self.is_sliding:
            return
        if self.device.type != "cpu":  # checked on the device: reading the count back would stall every step
            room = self.cumulative_length + tokens <= self.max_cache_len
            torch._assert_async(room, f"a static latent cache of {self.max_cache_len} tokens is full")
            return
        written = int(self.cumulative_length)
        if written + tokens > self.max_cache_len:
            raise ValueError(
                f"a static latent cache of {self.max_cache_len} tokens holds {written}: no room for {tokens} "
                "more (make it with a larger max_cache_len)"
            )

    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens seen (a 0-d tensor once a full layer is initialized, as transformers' static layers give it;
        a sliding layer's Python count)."""
        if self.is_sliding:
            return self.written
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of what the next update returns: every slot from 0 for a full layer;
        for a sliding one, what transformers' ``StaticSlidingWindowLayer`` announces for the same slots."""
        if not self.is_sliding:
            return self.max_cache_len, 0
        cap, written = self.capacity, self.written
        offset = max(written - cap + 1, 0)
        if written >= cap:
            return cap + query_length - 1, offset
        return max(written + query_length, cap), offset

    def get_max_length(self) -> int:
        return self.capacity

    @property
    def is_croppable(self) -> bool:
        """A sliding layer can be cropped only while it has dropped nothing."""
        return not self.is_sliding or self.written <= self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (their slots are written again by later updates)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if not self.is_croppable:
            raise RuntimeError("cannot crop a sliding static latent cache layer that has dropped tokens")
        if self.is_initialized:
            n = min(-tokens_to_remove, int(self.cumulative_length))
            self.cumulative_length.sub_(n)
            self.written -= n if self.is_sliding else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row ``beam_idx[i]``, in place (the buffers keep their addresses)."""
        for t in self._buffers():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._fixed_batch("repeated")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._fixed_batch("selected")

    def _fixed_batch(self, what: str) -> None:
        if self.is_initialized:
            raise NotImplementedError(
                f"a static latent cache's batch is fixed at its first update; its rows cannot be {what}"
            )

    def reset(self) -> None:
        """Forget every token, keeping the buffers (and their addresses)."""
        for t in self._buffers():
            t.zero_()
        self.cumulative_length.zero_()
        self.written = 0

    def _buffers(self) -> list[torch.Tensor]:
        if not self.is_initialized:
            return []
        positions = [] if self.store.positions is None else [self.store.positions]
        return [*self.store.parts.values(), *positions]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds: its preallocated buffers and its count of written tokens."""
        return [*self._buffers(), self.cumulative_length] if self.is_initialized else []


class StaticLatentCache(LatentUpdates, Cache):
    """A compressed model's preallocated cache: one :class:`StaticLatentLayer` per decoder layer.

    Parameters are :class:`~lrkv_core.cache.LatentCache`'s plus ``max_cache_len``, the tokens every layer
    holds (prompt and generated); :meth:`from_config` reads them off a compressed model's config.
    """

    def __init__(
        self,
        num_layers: int,
        max_cache_len: int,
        sliding_windows: Sequence[int | None] | None = None,
        *,
        ranks_k: Sequence[Sequence[int]] | None = None,
        ranks_v: Sequence[Sequence[int]] | None = None,
        storage: str | dict | CacheStorage = "dense",
    ) -> None:
        windows, ranks = check_layer_args(num_layers, sliding_windows, ranks_k, ranks_v)
        self.storage = CACHE_STORAGES.create(storage)
        layers = [
            StaticLatentLayer(max_cache_len, self.storage, rk, rv, sliding_window=w)
            for w, (rk, rv) in zip(windows, ranks)
        ]
        Cache.__init__(self, layers=layers)

    @classmethod
    def from_config(cls, config: PretrainedConfig, max_cache_len: int) -> StaticLatentCache:
        """Layers, ranks and storage as :meth:`LatentCache.from_config` reads them, ``max_cache_len`` tokens
        each."""
        num_layers, windows, options = layer_args(config)
        return cls(num_layers, max_cache_len, windows, **options)
