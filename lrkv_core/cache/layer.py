"""One layer of a latent cache: a storage strategy's store × a window policy, behind transformers' layer API.

The layer makes its store lazily, at the first update, from its storage config and its per-group ranks: the
ranks it was built with (``LatentCache.from_config`` reads them from the ``lrkv`` section), or else the ones
the first update brings (the latent attentions pass their layout). Every operation ``generate()`` performs on
a cache (beam reorder, batch expansion and selection, crop, reset) is a generic store operation, so it works
for every storage strategy and both window policies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import CacheLayerMixin

from .storage import CACHE_STORAGES, CacheStorage, LatentStore, LatentView
from .window import FullWindow, SlidingWindow

Ranks = tuple[tuple[int, ...], tuple[int, ...]]


def _ranks(ranks_k: Sequence[int], ranks_v: Sequence[int]) -> Ranks:
    return tuple(int(r) for r in ranks_k), tuple(int(r) for r in ranks_v)


def agreed_ranks(held: Ranks | None, given: tuple[Sequence[int], Sequence[int]] | None) -> Ranks | None:
    """The ranks a layer holds after an update that brings ``given`` (None: brings none): the layer's, or
    the update's if the layer has none yet; an update whose ranks differ from the layer's is an error."""
    if given is None:
        return held
    given = _ranks(*given)
    if held is not None and given != held:
        raise ValueError(f"latents of ranks {given} for a cache layer of ranks {held}")
    return given


class LatentLayerBase(CacheLayerMixin):
    """A cache layer that stores latents: transformers' key/value ``update`` is refused."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise TypeError("a latent cache layer stores latents, not keys and values: use update_latents")


class LatentLayer(LatentLayerBase):
    """One decoder layer's latent cache.

    Parameters
    ----------
    storage : the storage strategy (a name, ``{"name": ..., **options}`` or a :class:`CacheStorage`);
        default ``"dense"``.
    sliding_window : the layer's sliding window (:class:`SlidingWindow`), or None to keep every token.
    ranks_k, ranks_v : the layer's per-group ranks; None to learn them from the first update.

    Attributes
    ----------
    store : the :class:`LatentStore` holding the tokens (None until the first update).
    window : the window policy (:class:`FullWindow` or :class:`SlidingWindow`).
    """

    is_croppable = True
    supports_early_init = False  # a store needs the layer's ranks, not (B, H, 0, D) placeholders

    def __init__(
        self,
        storage: str | dict | CacheStorage = "dense",
        sliding_window: int | None = None,
        ranks_k: Sequence[int] | None = None,
        ranks_v: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if (ranks_k is None) != (ranks_v is None):
            raise ValueError("give both ranks_k and ranks_v, or neither")
        self.storage = CACHE_STORAGES.create(storage)
        self.window = FullWindow() if sliding_window is None else SlidingWindow(sliding_window)
        self.ranks: Ranks | None = None if ranks_k is None else _ranks(ranks_k, ranks_v)
        self.store: LatentStore | None = None

    @property
    def is_sliding(self) -> bool:
        return self.window.is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Make the store for latents like ``key_states`` (B, T, R_k), ``value_states`` (B, T, R_v)."""
        if self.ranks is None:
            raise ValueError(
                "a latent cache layer needs its per-group ranks: build the cache with "
                "LatentCache.from_config(model.config) or ranks_k/ranks_v, or update it with ranks="
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = self.storage.create_store(*self.ranks)
        self.is_initialized = True

    def update_latents(
        self,
        h_k: torch.Tensor,
        h_v: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        ranks: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> LatentView:
        """Store new latents h_k (B, T, R_k), h_v (B, T, R_v) (and positions); return what attention reads.

        The view holds the tokens kept before this update plus the new ones; a sliding window then drops the
        tokens no later query can see. ``ranks`` (per-group ranks of keys and values) must agree with the
        layer's, and set them if the layer has none yet. A layer caches positions from its first update on
        if that update has them, and never otherwise.
        """
        self.ranks = agreed_ranks(self.ranks, ranks)
        if not self.is_initialized:
            self.lazy_initialization(h_k, h_v)
        self.store.append(h_k, h_v, position_ids)
        view = self.store.view()
        keep = self.window.appended(h_k.shape[1])
        if keep is not None:
            self.store.keep_last(keep)
        return view

    def _stored(self) -> int:
        return len(self.store) if self.store is not None else 0

    def get_seq_length(self) -> int:
        """Tokens seen (a sliding layer counts the ones it dropped too, as transformers does)."""
        return self.window.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the latents the next update returns, as the mask expects."""
        return self.window.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.window.get_max_length()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (negative, as in transformers); refused once a
        sliding window is full."""
        self.window.check_crop()
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove, got {tokens_to_remove} "
                "(transformers no longer supports cropping to an absolute length)"
            )
        if tokens_to_remove < 0 and self.store is not None:
            self.store.crop(-tokens_to_remove)
        self.window.cropped(self._stored())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None:
            self.store.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            self.store.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None:
            self.store.select(indices)

    def activate_past_recording(self) -> None:
        self.window.activate_past_recording()

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()
        self.window.reset()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (its store's)."""
        return self.store.tensors() if self.store is not None else []
