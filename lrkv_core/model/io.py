"""The compressed model format: a directory that loads back into a ready HF model.

``config.json`` is the original config plus an ``lrkv`` section (the typed model-format section,
:class:`lrkv_core.format.LrkvFormat`: decomposition, allocator, group size, ranks, rope handling, cache
storage, versions) and ``quantization_config: {"quant_method": "lrkv"}``; ``model.safetensors`` holds the
new tensors; README.md is the model card. No pickle, no trust_remote_code: :func:`load_compressed`
rebuilds the module shapes from the ``lrkv`` section, and so does plain ``AutoModelForCausalLM
.from_pretrained`` once ``lrkv_core`` is imported (:mod:`lrkv_core.model.hf_quantizer`). The section records
the sha256 of ``model.safetensors`` (``weights_sha256``), which :func:`load_compressed` checks before using
it.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase
from transformers.initialization import no_init_weights

from ..data.refs import resolve_model_dir
from ..format import FORMAT_VERSION, FormatError, LrkvFormat, forget_weights_checksum
from ..system.dtypes import parse_dtype
from ..system.files import make_readable, replace_dir
from ..system.fingerprint import hash_file
from .fuse import build_latent_skeleton
from .hf_quantizer import LrkvConfig

_REMOTE = re.compile(r"[a-z][a-z0-9+.-]*:/")  # SCHEME:/... (models:/, s3://, runs:/): never a local path

WEIGHTS = "model.safetensors"


def is_compressed_dir(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and "lrkv" in json.loads(cfg.read_text())


def save_compressed(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    card: str | None = None,
) -> Path:
    """Write the model directory atomically (a temp sibling renamed into place when complete, see
    :func:`lrkv_core.system.files.replace_dir`); config.json's ``lrkv`` section records the weights' sha256.

    An existing ``out_dir`` is replaced only if it is empty or itself an lrkv model directory.
    """
    if not getattr(model.config, "lrkv", None):
        raise ValueError("model has no lrkv section in its config: compress it first")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not is_compressed_dir(out):
        raise FileExistsError(f"{out} exists and is not an lrkv model directory; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the final directory is an ordinary one
    try:
        save_model(model, str(tmp / WEIGHTS))
        make_readable(tmp / WEIGHTS)
        model.config.save_pretrained(tmp)
        _write_section(tmp / "config.json", LrkvFormat.of(model.config), hash_file(tmp / WEIGHTS))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(card or model_card(LrkvFormat.of(model.config)))
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_section(config_json: Path, fmt: LrkvFormat, weights_sha256: str) -> None:
    """Write the ``lrkv`` section in the current format with the weights' sha256, and add
    ``quantization_config: {"quant_method": "lrkv"}`` so plain from_pretrained can load the model."""
    data = json.loads(config_json.read_text())
    section = fmt.to_dict() | {"format_version": FORMAT_VERSION, "weights_sha256": weights_sha256}
    data["lrkv"] = section
    data["quantization_config"] = LrkvConfig().to_dict()
    config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


class ModelFileError(ValueError):
    """A compressed model directory whose files cannot be loaded (names the file and the problem)."""


def load_compressed(
    path: str | Path,
    *,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    verify: bool = True,
) -> nn.Module:
    """A ready HF model (eval mode, latent cache on) from a directory written by :func:`save_compressed`.

    ``path`` may also be a remote reference that a scheme plugin resolves (lrkv_tasks registers
    ``models:/NAME@ALIAS`` and ``s3://...``; see :mod:`lrkv_core.data.refs`). ``model.safetensors`` is checked
    against the sha256 that config.json records (models written before lrkv recorded it are loaded
    unchecked); ``verify=False`` skips the check, to save reading the file twice.

    Raises
    ------
    ModelFileError
        The directory is not an lrkv model, its ``lrkv`` section cannot be read (e.g. a newer format), or
        ``model.safetensors`` is missing, truncated, corrupt, does not hash to the recorded sha256 or
        does not match the ranks in config.json.
    """
    if isinstance(path, str) and _REMOTE.match(path):  # before Path(), which folds "s3://" to "s3:/"
        path = resolve_model_dir(path)  # models:/NAME@ALIAS, s3://...: a scheme plugin downloads it
    path = Path(path)
    if not is_compressed_dir(path):
        raise ModelFileError(
            f"{path} is not an lrkv compressed model (config.json without an 'lrkv' section)"
        )
    weights = path / WEIGHTS
    if not weights.is_file():
        raise ModelFileError(f"{weights}: missing")
    config = AutoConfig.from_pretrained(str(path))
    expected = config.lrkv.get("weights_sha256") if isinstance(config.lrkv, dict) else None
    forget_weights_checksum(config)
    kwargs = {"dtype": parse_dtype(dtype or getattr(config, "dtype", None) or "float32")}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with no_init_weights():  # every weight is loaded below (checked): random init would be wasted time
            model = AutoModelForCausalLM.from_config(config, **kwargs)
            build_latent_skeleton(model)
    except FormatError as err:
        raise ModelFileError(f"{path / 'config.json'}: {err}") from None
    model.tie_weights()  # what the skipped init_weights would have done (tied embeddings share one tensor)
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except SafetensorError as err:
        raise ModelFileError(
            f"{weights}: unreadable safetensors file (truncated or corrupt: {err})"
        ) from None
    except RuntimeError as err:  # torch's size mismatch on load_state_dict
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise ModelFileError(
            f"{weights}: tensor shapes do not match the ranks in config.json ({first})"
        ) from None
    if missing or unexpected:
        raise ModelFileError(
            f"{weights}: weights do not match the lrkv layout (missing {missing}, unexpected {unexpected})"
        )
    if verify and expected:  # after the load, so a file that does not even parse says so instead
        actual = hash_file(weights)
        if actual != expected:
            raise ModelFileError(
                f"{weights}: corrupt or modified: its sha256 is {actual[:12]}…, config.json records "
                f"{expected[:12]}…"
            )
    return model.eval()


def model_card(fmt: LrkvFormat, source: str | None = None) -> str:
    """The README.md of a compressed model: what was compressed, how, the ranks, and how to load it."""
    keys = {
        "reconstruct-then-rope": "Keys are rebuilt per group from their latents, then RoPE at the cached "
        "positions, then attention",
        "keys-fused-into-q": "The key up-projection is folded into q_proj (no RoPE): keys are never rebuilt",
        "rotated-keys": "The cache holds latents of the keys after RoPE (a RoPE-equivariant basis); each "
        "query absorbs the key up-projection, so keys are never rebuilt",
    }[fmt.rope]
    ranks = "\n".join(f"| {i} | {rk} | {rv} |" for i, (rk, rv) in enumerate(zip(fmt.ranks_k, fmt.ranks_v)))
    origin = f"Source model: `{source}`.\n\n" if source else ""
    cache = ", ".join(f"{k}={v}" for k, v in fmt.cache.items() if k != "name")
    rotation = (
        ""
        if fmt.rotation == "none"
        else f" Each group's latents are rotated ({fmt.rotation}, seed {fmt.rotation_seed}), the rotation "
        "fused into the down- and up-projections."
    )
    return (
        f"# lrkv compressed model\n\n{origin}"
        f"The KV cache stores low-rank latents: {fmt.decomposition['name']} decomposition per group of "
        f"{fmt.group_size} KV head(s), {fmt.allocator['name']} ranks rounded to multiples of "
        f"{fmt.rank_multiple}. Kept KV width: {fmt.achieved_ratio:.4f} of the original "
        f"(target {fmt.target_ratio}). {keys}; the value up-projection is folded into o_proj. "
        f"Cache storage: {fmt.cache['name']}{f' ({cache})' if cache else ''}.{rotation}\n\n"
        "| layer | K ranks per group | V ranks per group |\n|---|---|---|\n"
        f"{ranks}\n\nLoad: `lrkv_core.load_compressed(path)`, or "
        "`AutoModelForCausalLM.from_pretrained(path)` after `import lrkv_core` (no pickle, no "
        f"trust_remote_code). lrkv {fmt.lrkv_version} (model format {fmt.format_version}), "
        f"torch {torch.__version__}.\n"
    )
