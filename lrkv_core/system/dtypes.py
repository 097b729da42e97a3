"""Torch dtypes by the names recipes and the CLI use."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` for ``"float32"`` (a dtype is returned as is); a clear error for unknown names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return DTYPES[dtype]
