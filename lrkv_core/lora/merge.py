"""Fold trained LoRA adapters into the compressed model's own projections: nothing grows at inference.

For an adapted projection ``W`` (out × in) the merge writes ``W + (α / r′) B A`` into ``W`` itself (PEFT's
``merge_and_unload``), so every module keeps its class and shape. On ``k_down``/``v_down`` that changes what
the latents are, never their width: the ranks in the model-format section, the cache storage it records
(dense or quantized, with its options) and the KV bytes per token are those of the model before recovery,
and the merged model saves and loads as any compressed model (:func:`lrkv_core.save_compressed`).
"""

from __future__ import annotations

import copy

from torch import nn

from ..format import LrkvFormat
from ..model.adapters import get_adapter


def merge_lora(peft_model: nn.Module) -> nn.Module:
    """The base model of ``peft_model`` with its LoRA adapters merged into the adapted weights (eval mode).

    Uses PEFT's ``merge_and_unload(safe_merge=True)`` (a merged weight that is not finite is an error), then
    checks what the KV cache depends on (:func:`check_latent_widths`).
    """
    section = copy.deepcopy(peft_model.get_base_model().config.lrkv)
    merged = peft_model.merge_and_unload(safe_merge=True)
    if merged.config.lrkv != section:
        raise ValueError("merging LoRA changed the model's lrkv section")
    check_latent_widths(merged)
    return merged.eval()


def check_latent_widths(model: nn.Module) -> None:
    """Every layer's projections are plain ``nn.Linear`` again, and the cached latents keep the widths the
    model-format section gives (``k_down`` emits Σ_g r_k,g, ``v_down`` Σ_g r_v,g); else ``ValueError``."""
    fmt = LrkvFormat.of(model.config)
    adapter = get_adapter(model.config)
    for layer, (ranks_k, ranks_v) in enumerate(zip(fmt.ranks_k, fmt.ranks_v)):
        attn = adapter.attention(model, layer)
        for role, modules in attn.projections().items():
            wrapped = [type(m).__name__ for m in modules if type(m) is not nn.Linear]
            if wrapped:
                raise ValueError(
                    f"layer {layer} {role}: still wrapped ({', '.join(wrapped)}) after the merge"
                )
        widths = (attn.k_down.out_features, attn.v_down.out_features)
        if widths != (sum(ranks_k), sum(ranks_v)):
            raise ValueError(
                f"layer {layer}: latent widths {widths} differ from the ranks' {(sum(ranks_k), sum(ranks_v))}"
            )
