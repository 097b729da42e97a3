"""lrkv's embedded default model: a small Llama trained from scratch on the Python stdlib's docstrings.

The quickstart has to run on a fresh machine with no network, so lrkv builds its own model from text every
Python install has. ``ensure_builtin_model()`` builds it once (about two minutes on two CPU cores) into
``lrkv_home()/builtin/<name>`` and returns that directory afterwards; other code names it
``builtin:pydoc-llama`` (the ``builtin`` scheme, registered with lrkv_core's resolver by
:mod:`lrkv_demo.refs`). The directory loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` like any
Hugging Face checkpoint, and its ``README.md`` / ``build_info.json`` hold the numbers measured in the build.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from lrkv_core.system.paths import lrkv_home
from lrkv_demo.corpus import (  # noqa: F401  (re-exported: the build's corpus and tokenizer)
    BOS_TOKEN,
    DOC_SEPARATOR,
    EOS_TOKEN,
    SKIP_DIRS,
    collect_stdlib_docstrings,
    split_corpus,
    train_tokenizer,
)

logger = logging.getLogger(__name__)

DEFAULT_BUILTIN = "pydoc-llama"
SAMPLE_PROMPT = "Return the"
_PARTIAL = ".partial-"
_STALE_PARTIAL_S = 24 * 3600.0

ProgressFn = Callable[[int, int, float], None]


@dataclass(frozen=True)
class BuiltinSpec:
    """Everything that defines one built-in model: architecture, data split and training recipe."""

    vocab_size: int = 512
    hidden_size: int = 128  # d
    num_hidden_layers: int = 4  # L
    num_attention_heads: int = 4  # H
    num_key_value_heads: int = 2  # Hkv
    head_dim: int = 32  # D
    intermediate_size: int = 344
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    steps: int = 600
    batch_size: int = 16  # B
    seq_len: int = 128  # T, for training and for the valid windows
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    valid_fraction: float = 0.05
    max_corpus_chars: int = 3_000_000

    def llama_config(self) -> LlamaConfig:
        """The ``LlamaConfig`` of this spec (GQA, RoPE, tied embeddings, bos 0, eos 1)."""
        arch = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        return LlamaConfig(
            **{k: getattr(self, k) for k in arch},
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )


BUILTIN_MODELS: dict[str, BuiltinSpec] = {DEFAULT_BUILTIN: BuiltinSpec()}


def _lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _train_model(
    model: LlamaForCausalLM,
    train_ids: torch.Tensor,
    spec: BuiltinSpec,
    steps: int,
    seed: int,
    progress: ProgressFn | None,
) -> list[float]:
    """AdamW with warmup + cosine on random (B, T) windows of ``train_ids`` (N,); returns per-step losses."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95))
    warmup = max(1, min(spec.warmup_steps, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, warmup, steps, spec.min_lr_ratio))
    offsets = torch.arange(spec.seq_len)  # (T,)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        starts = torch.randint(0, train_ids.numel() - spec.seq_len + 1, (spec.batch_size,), generator=gen)
        x = train_ids[starts[:, None] + offsets]  # (B, T)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, steps, losses[-1])
        elif (step + 1) % 50 == 0 or step + 1 == steps:
            logger.info("step %d/%d  loss %.4f  lr %.2e", step + 1, steps, losses[-1], sched.get_last_lr()[0])
    model.eval()
    return losses


@torch.no_grad()
def evaluate_nll(model: LlamaForCausalLM, ids: torch.Tensor, seq_len: int, batch_size: int = 32) -> float:
    """Mean next-token NLL (nats) of ``ids`` (N,) over non-overlapping ``seq_len`` windows (tail dropped)."""
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"need at least {seq_len} tokens to evaluate, got {ids.numel()}")
    windows = ids[: n * seq_len].view(n, seq_len)  # (N, T)
    total = 0.0
    for x in windows.split(batch_size):
        logits = model(input_ids=x).logits.float()  # (b, T, V)
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    return total / (n * (seq_len - 1))


def build_builtin_model(
    out_dir: Path,
    *,
    steps: int | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
    spec: BuiltinSpec = BUILTIN_MODELS[DEFAULT_BUILTIN],
) -> Path:
    """Build the model in ``out_dir``: corpus split, tokenizer, training, evaluation, model card.

    Parameters
    ----------
    out_dir : Path
        Where to write (created if missing): ``train.txt``, ``valid.txt``, tokenizer files, ``config.json``,
        ``model.safetensors`` (float32), ``generation_config.json``, ``build_info.json`` and ``README.md``.
    steps : int, optional
        Optimizer steps; default ``spec.steps`` (about two minutes of total build time on two CPU cores).
    seed : int
        Seeds the initialization and the batch sampling; with the same Python stdlib the build is repeatable.
    progress : callable, optional
        ``progress(step, total, loss)`` after every step; without it, progress is logged.
    spec : BuiltinSpec
        Architecture and recipe.

    Returns
    -------
    Path
        ``out_dir``.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = spec.steps if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    corpus = collect_stdlib_docstrings(max_chars=spec.max_corpus_chars)
    train_text, valid_text = split_corpus(corpus, spec.valid_fraction)
    (out_dir / "train.txt").write_text(train_text, encoding="utf-8")
    (out_dir / "valid.txt").write_text(valid_text, encoding="utf-8")

    tokenizer = train_tokenizer(train_text, spec.vocab_size, spec.max_position_embeddings)
    encode = tokenizer.backend_tokenizer.encode  # whole text at once, no max-length warning
    train_ids = torch.tensor(encode(train_text).ids, dtype=torch.long)  # (N_train,)
    valid_ids = torch.tensor(encode(valid_text).ids, dtype=torch.long)  # (N_valid,)
    logger.info("corpus %d chars: %d train, %d valid tokens", len(corpus), len(train_ids), len(valid_ids))

    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(spec.llama_config())
    t_train = time.perf_counter()
    losses = _train_model(model, train_ids, spec, steps, seed, progress)
    train_seconds = time.perf_counter() - t_train
    valid_nll = evaluate_nll(model, valid_ids, spec.seq_len)

    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    prompt = tokenizer(SAMPLE_PROMPT, return_tensors="pt")
    sample_ids = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    tail = max(1, len(losses) // 10)
    info = {
        "name": next((k for k, v in BUILTIN_MODELS.items() if v == spec), None),
        "spec": asdict(spec),
        "steps": steps,
        "seed": seed,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "corpus_chars": len(corpus),
        "train_chars": len(train_text),
        "valid_chars": len(valid_text),
        "train_tokens": len(train_ids),
        "valid_tokens": len(valid_ids),
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-tail:]) / tail,
        "loss_curve": losses[:: max(1, steps // 50)],
        "valid_nll": valid_nll,
        "valid_ppl": math.exp(valid_nll),
        "valid_windows": len(valid_ids) // spec.seq_len,
        "sample_prompt": SAMPLE_PROMPT,
        "sample": tokenizer.decode(sample_ids[0]),
        "train_seconds": train_seconds,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info["seconds"] = time.perf_counter() - t0
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    (out_dir / "README.md").write_text(_model_card(info), encoding="utf-8")
    logger.info("built %s in %.1fs: valid ppl %.2f", out_dir, info["seconds"], info["valid_ppl"])
    return out_dir


_MODEL_CARD = """# {name}

A {mparams:.2f}M-parameter Llama trained from scratch by lrkv on the docstrings of the Python {python}
standard library: lrkv's offline default model, built on a CPU in minutes from text every Python install
has. A test subject for KV-cache compression, not a useful language model.

## Architecture
Llama, {spec[num_hidden_layers]} layers, hidden {spec[hidden_size]}, {spec[num_attention_heads]} query heads
and {spec[num_key_value_heads]} key/value heads (GQA) of dim {spec[head_dim]}, MLP {spec[intermediate_size]},
RoPE theta {spec[rope_theta]:g}, {spec[max_position_embeddings]} positions, tied embeddings, float32.
Tokenizer: byte-level BPE, vocab {spec[vocab_size]}, `<|bos|>` = 0, `<|eos|>` = 1, none added on encode.

## How it was built
- Corpus: module, class and function docstrings of the stdlib, read with `ast` (never imported), in sorted
  path order, joined by blank lines: {corpus_chars:,} characters.
- Split: first {train_share:.0%} `train.txt` ({train_chars:,} chars, {train_tokens:,} tokens), last
  {valid_share:.0%} `valid.txt` ({valid_chars:,} chars, {valid_tokens:,} tokens); tokenizer trained on train.
- Training: {steps} AdamW steps on {spec[batch_size]} x {spec[seq_len]}-token random windows, peak lr
  {spec[lr]:g}, warmup + cosine, grad clip {spec[grad_clip]:g}, seed {seed}.
- Time: {train_seconds:.1f} s training, {seconds:.1f} s whole build (torch {torch}, transformers
  {transformers}, {threads} threads).

## Measured in this build
- Train loss: {train_loss_first:.3f} at the first step, {train_loss_last:.3f} averaged over the last tenth.
- Valid: mean NLL {valid_nll:.4f} nats/token, perplexity **{valid_ppl:.2f}** over {valid_windows}
  non-overlapping {spec[seq_len]}-token windows (uniform guessing: {spec[vocab_size]}).
- Greedy sample: `{sample!r}`

All numbers are in `build_info.json`.
"""


def _model_card(info: dict) -> str:
    """README.md for a build, from the numbers measured in it."""
    share = info["spec"]["valid_fraction"]
    fields = {"name": "lrkv builtin model"} | {k: v for k, v in info.items() if v is not None}
    return _MODEL_CARD.format(
        **fields, mparams=info["num_parameters"] / 1e6, train_share=1 - share, valid_share=share
    )


def _remove_stale_partials(parent: Path, name: str) -> None:
    """Delete partial builds of ``name`` left by killed processes (older than a day, so none in progress)."""
    now = time.time()
    for p in parent.glob(f"{name}{_PARTIAL}*"):
        try:
            if now - p.stat().st_mtime > _STALE_PARTIAL_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            continue


def ensure_builtin_model(name: str = DEFAULT_BUILTIN, home: Path | None = None, **build_kwargs) -> Path:
    """Directory of built-in model ``name``, built on first use into ``<home>/builtin/<name>``.

    Parameters
    ----------
    name : str
        A key of ``BUILTIN_MODELS``.
    home : Path, optional
        Root instead of ``lrkv_home()``.
    **build_kwargs
        Passed to :func:`build_builtin_model` (``steps``, ``seed``, ``progress``); only used when building.

    Returns
    -------
    Path
        The finished model directory. It is built in a sibling ``<name>.partial-*`` directory and renamed
        into place when complete, so an interrupted build leaves no target; if another process finished
        first, its build is kept and this one discarded.
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; available: {', '.join(sorted(BUILTIN_MODELS))}")
    parent = Path(home if home is not None else lrkv_home()) / "builtin"
    target = parent / name
    if target.is_dir():
        return _check_complete(target, build_kwargs)
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(parent, name)
    tmp = parent / f"{name}{_PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build_builtin_model(tmp, spec=BUILTIN_MODELS[name], **build_kwargs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise
        logger.info("%s was finished by another process meanwhile; keeping it", target)
    return _check_complete(target, build_kwargs)


def _check_complete(target: Path, build_kwargs: dict) -> Path:
    """``target`` if it holds a finished build; warns when it was built with another ``steps``/``seed``."""
    info_path = target / "build_info.json"
    if not info_path.is_file():
        raise RuntimeError(f"{target} exists but holds no finished build (no build_info.json); delete it")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    for key in ("steps", "seed"):
        if key in build_kwargs and build_kwargs[key] != info.get(key):
            logger.warning(
                "%s was built with %s=%s; %s=%s ignored", target, key, info.get(key), key, build_kwargs[key]
            )
    return target
