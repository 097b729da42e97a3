"""Integer quantization of cached latents: per-token asymmetric quantization (:mod:`.integer`) and bit packing
(:mod:`.packing`), pure functions on tensors, each beside the reference it is tested against."""

from .integer import INTEGER_BITS, QuantizedRows, dequantize, fake_quantize, group_widths, quantize
from .packing import PACKED_BITS, pack_codes, pack_codes_ref, packed_width, unpack_codes, unpack_codes_ref

__all__ = [
    "INTEGER_BITS",
    "PACKED_BITS",
    "QuantizedRows",
    "dequantize",
    "fake_quantize",
    "group_widths",
    "pack_codes",
    "pack_codes_ref",
    "packed_width",
    "quantize",
    "unpack_codes",
    "unpack_codes_ref",
]
