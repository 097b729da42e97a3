"""Load models and read their tensors without loading them.

Model references (a local directory, a hub id, ``SCHEME:REST`` such as ``builtin:NAME``) resolve in
:mod:`lrkv_core.data.refs`; ``resolve_model_dir`` is importable from here too.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ..data.refs import resolve_model_dir  # also imported from here by callers
from ..system.dtypes import parse_dtype
from ..system.fingerprint import hash_dir
from .adapters import get_adapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DEVICE_FORMS = "cpu, cuda, cuda:N or auto (cuda where torch sees a GPU, else cpu)"
# transformers' from_pretrained is not thread-safe: two at once in one process (the flows' thread runner
# collecting statistics side by side) both fail with "Cannot copy out of meta tensor". Loads take turns.
_LOADING = threading.RLock()


def parse_device(device: str | torch.device, *, here: bool = True) -> torch.device:
    """The torch device for ``cpu``, ``cuda``, ``cuda:N`` or ``auto``; a clear error for other names and, with
    ``here``, for a GPU torch cannot use on this machine (a CPU build, no device, an index past the last one).
    ``auto`` is the GPU where torch sees one, else the CPU (with ``here`` False: ``cuda``)."""
    if isinstance(device, torch.device):
        return device
    if device == "auto" and not here:
        return torch.device("cuda")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: choose {DEVICE_FORMS}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: choose {DEVICE_FORMS}")
    if parsed.type == "cuda" and here:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device}: torch {torch.__version__} sees no CUDA device here")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return parsed


def share_equal_weights(model: nn.Module, base: nn.Module) -> int:
    """Make ``model`` use ``base``'s tensor for every parameter and buffer of the same name that is equal to
    it (same shape, dtype, device and values), so that the two held side by side take little more memory than
    one: a compressed model differs from its original in its attention projections only. Nothing either
    model computes changes. Returns the bytes ``model`` no longer holds of its own."""
    theirs = dict(base.named_parameters(remove_duplicate=False)) | dict(base.named_buffers())
    freed = 0
    for name, mine in [*model.named_parameters(), *model.named_buffers()]:  # a tied tensor once, by one name
        other = theirs.get(name)
        if other is None or other.data_ptr() == mine.data_ptr():
            continue
        same_kind = (other.shape, other.dtype, other.device) == (mine.shape, mine.dtype, mine.device)
        if same_kind and torch.equal(other, mine):
            freed += mine.numel() * mine.element_size()
            mine.data = other.data
    return freed


def model_fingerprint(model_dir: str | Path) -> str:
    """Content hash of the files that decide a model's behaviour (config, weights, tokenizer)."""
    return hash_dir(model_dir)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer, or None when the directory ships none (token-id-only models)."""
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".bin.index.json")


def missing_safetensors(model_dir: str | Path) -> str | None:
    """What is wrong with a model directory that has no safetensors weights (None when it has them): lrkv
    never reads pickle weights (``pytorch_model.bin``), which can run code when loaded."""
    names = {p.name for p in Path(model_dir).iterdir()}
    if names.intersection(SAFETENSORS_FILES):
        return None
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    found = f"only {', '.join(pickles)}" if pickles else "no weights file"
    return (
        f"has no model.safetensors ({found}); lrkv reads safetensors weights only, never pickle: "
        "save the model with safe_serialization=True first"
    )


def load_model(
    ref: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, PreTrainedTokenizerBase | None]:
    """Load ``(model, tokenizer)`` in eval mode on ``device`` (:func:`parse_device`); lrkv-compressed
    directories load through load_compressed. Safe to call from several threads at once (loads take turns)."""
    device = parse_device(device)
    model_dir = resolve_model_dir(ref)  # a Path is always a local directory, never SCHEME:REST
    config = AutoConfig.from_pretrained(str(model_dir))
    if getattr(config, "lrkv", None):
        from .io import load_compressed

        with _LOADING:
            model = load_compressed(model_dir, dtype=dtype, attn_implementation=attn_implementation)
            return model.to(device), load_tokenizer(model_dir)
    get_adapter(config)  # fail early, with the list of supported families
    problem = missing_safetensors(model_dir)
    if problem is not None:
        raise FileNotFoundError(f"model {model_dir} {problem}")
    kwargs = {"dtype": parse_dtype(dtype), "use_safetensors": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with _LOADING:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs).eval()
        return model.to(device), load_tokenizer(model_dir)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no model.safetensors (other weight formats are not supported)"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def read_tensors(model_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors from a model directory's safetensors files."""
    files = _weight_files(Path(model_dir))
    out = {}
    for name in names:
        if name not in files:
            raise KeyError(f"tensor {name} not found in {model_dir}")
        with safe_open(str(files[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out
