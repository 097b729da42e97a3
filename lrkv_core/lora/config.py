"""What one LoRA recovery run does: :class:`RecoveryConfig`, the in-memory twin of a recipe's ``lora:``.

Compression at high ratios costs perplexity; Palu (Appendix, "LoRA fine-tuning") and Eigen Attention recover
most of it with a short LoRA fine-tune of the compressed model. The defaults follow Palu where they fit:
rank r′ = 32, α = 32, learning rate 2e-4 with a cosine schedule. The adapted projections are named by their
role in the latent attention module (:meth:`lrkv_core.model.attention.LatentAttentionBase.projections`), never
by a module-name pattern:

- ``k_down``, ``v_down`` (default): the down-projections whose outputs the cache stores. Training them
  changes the latents, not their width: after the merge the cache holds as many bytes per token as before.
  With latents of rotated keys ``k_down`` adapts ``k_proj``, before RoPE, so the scores stay relative.
- ``k_up``: the per-group key up-projections (RoPE models whose keys are rebuilt; models without RoPE have
  none, their ``B_k`` is folded into ``q_proj``; latents of rotated keys refuse it).
- ``q_proj``, ``o_proj``: the query projection and the output projection with ``B_v`` folded in.

Two objectives. ``nll`` (Palu's, the default) fits the training text: on text of the kind it is evaluated
on, the recovered model's perplexity can fall below the original's while its predictions move away from
the original's. ``distill`` fits the original model instead: each scored token's loss is the KL divergence
from the original's next-token distribution to the compressed model's (the original runs beside it, without
gradients: its memory, and half again the training time on SmolLM2 on a CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

Role = Literal["k_down", "v_down", "k_up", "q_proj", "o_proj"]
Scheduler = Literal["cosine", "linear", "constant"]
Objective = Literal["nll", "distill"]
ROLES: tuple[str, ...] = get_args(Role)
SCHEDULERS: tuple[str, ...] = get_args(Scheduler)
OBJECTIVES: tuple[str, ...] = get_args(Objective)
DEFAULT_TARGETS = ("k_down", "v_down")


@dataclass(frozen=True)
class RecoveryConfig:
    """One LoRA recovery run: the adapter, the optimisation, the data shapes, evaluation and checkpoints.

    Parameters
    ----------
    steps : optimizer steps.
    r, alpha, dropout : LoRA rank r′, scale numerator α (the update is ``(α / r′) B A``) and dropout on the
        adapter's input.
    targets : roles of the latent attention's projections that get adapters (:data:`ROLES`).
    lr, scheduler, warmup_steps, weight_decay, max_grad_norm : AdamW with a warm-up then the schedule
        (``cosine`` to 0, ``linear`` to 0, or ``constant``); gradients clipped to ``max_grad_norm`` (None:
        not clipped).
    objective : ``nll`` (the training text's next tokens) or ``distill`` (the original model's next-token
        distributions: KL(original ‖ compressed) per scored token).
    batch_size, grad_accum, seq_len : rows per micro-batch, micro-batches per step, tokens per row. Each
        step's loss is the mean of the objective over all scored tokens of its ``batch_size · grad_accum``
        rows.
    eval_every, eval_rows : held-out loss every ``eval_every`` steps (and before the first and after the
        last) on the first ``eval_rows`` held-out rows; 0 turns it off.
    checkpoint_every : steps between checkpoints (0: none); the last step is always checkpointed.
    seed : seeds the adapter's initialisation, dropout and the order rows are drawn in.

    A recipe's ``lora:`` section is built from these fields (types, defaults, and each field's ``help`` as its
    description), so they are defined once.
    """

    steps: int = 200
    r: int = field(default=32, metadata={"help": "LoRA rank r′"})
    alpha: float = field(default=32.0, metadata={"help": "LoRA α (the update is α/r′ · B A)"})
    dropout: float = 0.0
    targets: tuple[Role, ...] = field(
        default=DEFAULT_TARGETS, metadata={"help": "latent-attention projections that get adapters"}
    )
    lr: float = 2e-4
    scheduler: Scheduler = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    objective: Objective = field(
        default="nll", metadata={"help": "nll: fit the text's next tokens; distill: the original's outputs"}
    )
    batch_size: int = 4
    grad_accum: int = 1
    seq_len: int = 256
    eval_every: int = field(default=50, metadata={"help": "steps between held-out losses (0: none)"})
    eval_rows: int = 8
    checkpoint_every: int = field(
        default=50, metadata={"help": "steps between checkpoints (0: only the last)"}
    )
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        for name in ("steps", "r", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoRA {name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "eval_rows", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoRA {name} must be ≥ 0, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"LoRA seq_len must be ≥ 2 (one prediction), got {self.seq_len}")
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets must be distinct and not empty, got {list(self.targets)}")
        unknown = [t for t in self.targets if t not in ROLES]
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; choose from {', '.join(ROLES)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose from {', '.join(SCHEDULERS)}")
        if self.objective not in OBJECTIVES:
            choices = ", ".join(OBJECTIVES)
            raise ValueError(f"unknown LoRA objective {self.objective!r}; choose from {choices}")
        if not 0 <= self.dropout < 1 or self.lr <= 0 or self.alpha <= 0:
            raise ValueError("LoRA needs 0 ≤ dropout < 1, lr > 0 and alpha > 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        """The options as plain JSON (targets as a list); what checkpoints and model cards record."""
        out = asdict(self)
        out["targets"] = list(self.targets)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecoveryConfig:
        """The config of :meth:`to_dict`'s form; unknown options fail."""
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown LoRA options {unknown}")
        return cls(**data)
