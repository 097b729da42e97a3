"""Window policies of a latent cache layer: which past tokens it keeps, and the sizes the mask expects.

- :class:`FullWindow` keeps every token, like transformers' ``DynamicLayer``;
- :class:`SlidingWindow` keeps the last ``window − 1`` tokens, mirroring ``DynamicSlidingWindowLayer``: an
  update returns the kept tokens plus the new ones (what :meth:`SlidingWindow.get_mask_sizes` announces to
  the mask), then the layer drops what no later query can see.

A policy only counts tokens and says how many to keep; the layer applies that to its store, whatever the
storage strategy, so a sliding layer is a policy, not a subclass per storage.
"""

from __future__ import annotations


class FullWindow:
    """Keep every token. ``cumulative_length`` counts the tokens the layer has seen (and still holds)."""

    is_sliding = False

    def __init__(self) -> None:
        self.cumulative_length = 0

    def appended(self, n_new: int) -> int | None:
        """Count ``n_new`` new tokens; return how many tokens the layer keeps (None: all)."""
        self.cumulative_length += n_new
        return None

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the latents the next update returns: every token, from 0."""
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def check_crop(self) -> None:
        """A full layer can always be cropped: it still holds every token."""

    def cropped(self, stored: int) -> None:
        """The layer now holds ``stored`` tokens after a crop."""
        self.cumulative_length = stored

    def activate_past_recording(self) -> None:
        """A full layer keeps every past token already: there is nothing more to record."""

    def reset(self) -> None:
        self.cumulative_length = 0


class SlidingWindow(FullWindow):
    """Keep the last ``sliding_window − 1`` tokens; ``cumulative_length`` counts every token ever seen."""

    is_sliding = True

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        self.sliding_window = int(sliding_window)

    def appended(self, n_new: int) -> int:
        super().appended(n_new)
        return self.sliding_window - 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The kept tokens (at most ``window − 1``) plus the query, starting at the first kept position."""
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        kept = min(self.cumulative_length, self.sliding_window - 1)
        return kept + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def check_crop(self) -> None:
        if self.cumulative_length >= self.sliding_window:
            raise RuntimeError(
                "cannot crop a sliding-window latent cache layer once its window is full: the tokens "
                "before the window are gone"
            )

    def activate_past_recording(self) -> None:
        raise NotImplementedError(
            "the latent cache does not record states past the sliding window (needed for assisted decoding)"
        )
