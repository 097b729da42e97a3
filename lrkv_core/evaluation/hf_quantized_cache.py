"""The anchor: transformers' own quantized KV cache (``QuantizedCache``, KIVI-style) on the *original* model.

Evaluated side by side with lrkv's quantized latent cache at the same bits, it shows what low rank adds on
top of quantizing the full keys and values. Two integer backends are supported, both optional installs
(``pip install 'lrkv[anchor]'``): ``quanto`` (optimum-quanto; 2 and 4 bits, min/max scales) and ``hqq``
(2, 3, 4 and 8 bits; scales and zero-points refined by HQQ's half-quadratic solver).

Both quantize per token, like lrkv: groups of ``q_group_size`` channels along each head's D (default D: one
group per token and head), which is quanto's ``axis=0`` and HQQ's ``axis=1``. Scales and zero-points stay
in the model's dtype (float32 here), as the backends store them. transformers keeps up to
``residual_length`` newest tokens in full precision and re-quantizes the whole cache when that window
fills; like every ``QuantizedCache``, the first update (the prompt) is attended in full precision and
quantized only for later steps, so its prefill perplexity is the original model's and its decode
perplexity is what it costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig, QuantizedCache

from ..model.adapters import get_adapter

BACKEND_BITS = {"quanto": (2, 4), "hqq": (2, 3, 4, 8)}
PER_TOKEN_AXIS = {"quanto": 0, "hqq": 1}  # each backend's axis for groups along the channel dim


@dataclass(frozen=True)
class HfQuantizedCacheSpec:
    """A transformers ``QuantizedCache`` configuration: ``backend``, ``bits``, group size (None: the head
    dim), and the full-precision window ``residual_length``."""

    backend: str
    bits: int
    q_group_size: int | None = None
    residual_length: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_BITS:
            raise ValueError(f"unknown QuantizedCache backend {self.backend!r}; choose {list(BACKEND_BITS)}")
        if self.bits not in BACKEND_BITS[self.backend]:
            allowed = BACKEND_BITS[self.backend]
            raise ValueError(f"the {self.backend} backend takes {allowed} bits, not {self.bits}")
        if self.residual_length < 0:
            raise ValueError(f"residual_length must be ≥ 0, got {self.residual_length}")

    @classmethod
    def parse(cls, text: str) -> HfQuantizedCacheSpec:
        """``BACKEND:BITS[:GROUP[:RESIDUAL]]``, e.g. ``hqq:4`` or ``quanto:2:32:0``."""
        fields = text.split(":")
        if not 2 <= len(fields) <= 4:
            raise ValueError(f"a QuantizedCache spec is BACKEND:BITS[:GROUP[:RESIDUAL]], got {text!r}")
        try:
            numbers = [int(f) for f in fields[1:]]
        except ValueError:
            raise ValueError(f"bits, group size and residual must be integers in {text!r}") from None
        group = numbers[1] if len(numbers) > 1 else None
        return cls(fields[0], numbers[0], group, numbers[2] if len(numbers) > 2 else 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def make(self, config: PretrainedConfig) -> QuantizedCache:
        """An empty ``QuantizedCache`` for an original model with ``config`` (per-token groups)."""
        if getattr(config, "lrkv", None):
            raise ValueError("transformers' QuantizedCache is the anchor for original models, not lrkv ones")
        head_dim = get_adapter(config).shape(config).D
        group = self.q_group_size or head_dim
        if head_dim % group:
            raise ValueError(f"QuantizedCache group size {group} does not divide the head dim {head_dim}")
        axis = PER_TOKEN_AXIS[self.backend]
        return QuantizedCache(
            self.backend,
            config,
            nbits=self.bits,
            axis_key=axis,
            axis_value=axis,
            q_group_size=group,
            residual_length=self.residual_length,
        )
