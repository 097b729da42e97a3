"""Which modules of a compressed model get LoRA adapters: found through the model's structure.

Layers come from the architecture adapter (:func:`lrkv_core.model.adapters.get_adapter`), and each layer's
latent attention says which projection plays which role (:meth:`~lrkv_core.model.attention.LatentAttentionBase
.projections`). The result is the exact module names PEFT is given, one per adapted projection; nothing is
matched by a name pattern.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..model.adapters import get_adapter
from ..model.attention import LatentAttentionBase


def target_modules(model: nn.Module, roles: Sequence[str]) -> dict[str, nn.Linear]:
    """Full module name → projection, for every layer and every role in ``roles``.

    Raises
    ------
    ValueError
        The model is not lrkv-compressed (a layer's attention is not a latent attention), or a role does not
        exist in this model's latent attention (``k_up`` in a model without RoPE).
    """
    adapter = get_adapter(model.config)
    names = {id(module): name for name, module in model.named_modules()}
    out: dict[str, nn.Linear] = {}
    for layer in range(adapter.shape(model.config).L):
        attn = adapter.attention(model, layer)
        if not isinstance(attn, LatentAttentionBase):
            raise ValueError(
                f"layer {layer}'s attention is {type(attn).__name__}, not a latent attention: "
                "LoRA recovery adapts lrkv-compressed models"
            )
        projections = attn.projections()
        for role in roles:
            if role not in projections:
                raise ValueError(
                    f"LoRA target {role!r} does not exist in {type(attn).__name__} "
                    f"(it has {', '.join(sorted(projections))})"
                )
            for module in projections[role]:
                out[names[id(module)]] = module
    return out


def check_targets(model_type_rope: bool, roles: Sequence[str], key_latents: str = "rebuilt") -> None:
    """Fail before any work when a role cannot exist: ``k_up`` needs a model whose keys are rebuilt (RoPE,
    not latents of rotated keys)."""
    if "k_up" in roles and key_latents == "rotated":
        raise ValueError(
            "LoRA target 'k_up' cannot adapt latents of rotated keys: the queries absorb it after RoPE, "
            "where a change would make the scores depend on absolute positions (k_down adapts the keys "
            "before RoPE)"
        )
    if "k_up" in roles and not model_type_rope:
        raise ValueError(
            "LoRA target 'k_up' needs a RoPE model: without RoPE the key up-projection is folded into q_proj "
            "(target q_proj instead)"
        )
