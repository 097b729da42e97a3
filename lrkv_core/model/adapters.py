"""One table of architecture facts, keyed by ``config.model_type``.

Everything that differs between model families (where the decoder layers live, the attention
attribute, projection names, RoPE, which kwargs the attention interface wants) is read from here, so
the methods never branch on module classes or match layer names by substring. Biases need no entry:
fusion reads them from the projections themselves (Qwen2: q/k/v; OPT: q/k/v/out). Where one projection
computes queries, keys and values (Phi-3's ``qkv_proj``), ``q_name``/``k_name``/``v_name`` all name it and
:meth:`ArchAdapter.rows` says which of its output rows are which; :meth:`ArchAdapter.linear` reads one part.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig


class UnsupportedModelError(ValueError):
    """The model's architecture has no adapter, or uses a feature lrkv does not handle."""


@dataclass(frozen=True)
class LinearPart:
    """One of q/k/v/o as a weight (out, d) and bias (out,) or None: views of the projection computing it."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class AttnShape:
    """Attention geometry: L layers, hidden d, H query heads, Hkv KV heads, head dim D."""

    L: int
    d: int
    H: int
    Hkv: int
    D: int

    @property
    def n_rep(self) -> int:
        return self.H // self.Hkv

    @property
    def kv_width(self) -> int:
        """Width of one of K or V in one layer: Hkv·D."""
        return self.Hkv * self.D


@dataclass(frozen=True)
class ArchAdapter:
    """How to find and rebuild the attention of one model family."""

    model_type: str
    layers_path: str = "model.layers"
    attn_attr: str = "self_attn"
    q_name: str = "q_proj"
    k_name: str = "k_proj"
    v_name: str = "v_proj"
    o_name: str = "o_proj"
    # "module:Class" of the rotary embedding built from the config; None for models without RoPE (OPT's
    # learned absolute positions are added to the embeddings, outside attention)
    rotary: str | None = "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding"
    # how the attention interface gets ``sliding_window``: not at all, config.sliding_window for every
    # layer (Mistral), or only for layers whose ``config.layer_types`` entry is "sliding_attention" (Qwen2)
    sliding_window: Literal["none", "all", "layer_types"] = "none"
    # "module:Class" of the per-head RMSNorm of queries and keys before RoPE (Qwen3's QK-norm), built as
    # ``Class(D, eps=config.rms_norm_eps)`` under the attention attributes ``q_norm`` and ``k_norm``; None for
    # families without one. Keys are rebuilt from latents, then normed, then rotated: the norm is never
    # applied to latents. ``qk_norm_offset`` is added to the norm's weight to get its scale (Gemma's 1 + w).
    qk_norm: str | None = None
    qk_norm_offset: float = 0.0
    # queries, keys and values come from one projection (Phi-3's qkv_proj: rows q, then k, then v)
    fused_qkv: bool = False
    # the config field s whose s^-½ is the softmax scale (Gemma 3's query_pre_attn_scalar); None: D^-½
    scaling_field: str | None = None
    # the rotary embedding holds one set of frequencies per layer type and is called with the layer's type
    # (Gemma 3: sliding layers rotate with rope_local_base_freq, full ones with rope_theta)
    rope_per_layer_type: bool = False

    @property
    def rope(self) -> bool:
        """Whether keys are rotated inside attention (then they are rebuilt from latents at decode)."""
        return self.rotary is not None

    def shape(self, config: PretrainedConfig) -> AttnShape:
        H = config.num_attention_heads
        Hkv = getattr(config, "num_key_value_heads", None) or H
        D = getattr(config, "head_dim", None) or config.hidden_size // H
        return AttnShape(L=config.num_hidden_layers, d=config.hidden_size, H=H, Hkv=Hkv, D=D)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        mod = model
        for part in self.layers_path.split("."):
            mod = getattr(mod, part)
        return mod

    def base_model(self, model: nn.Module) -> nn.Module:
        """The decoder stack whose forward creates the cache (``model.model`` for Llama)."""
        mod = model
        for part in self.layers_path.split(".")[:-1]:
            mod = getattr(mod, part)
        return mod

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return getattr(self.layers(model)[layer], self.attn_attr)

    def set_attention(self, model: nn.Module, layer: int, module: nn.Module) -> None:
        setattr(self.layers(model)[layer], self.attn_attr, module)

    def weight_name(self, layer: int, proj: str) -> str:
        """State-dict prefix of a projection in the original model (``model.layers.3.self_attn.k_proj``); with
        fused q/k/v the fused projection's (its :meth:`rows` are ``proj``'s)."""
        return f"{self.layers_path}.{layer}.{self.attn_attr}.{getattr(self, proj + '_name')}"

    def rows(self, config: PretrainedConfig, proj: str) -> slice:
        """The rows of ``proj`` ("q", "k", "v", "o") in the output of the projection computing it: all of
        them, unless q/k/v are fused (then q's H·D rows, k's Hkv·D, v's Hkv·D, in that order)."""
        if not self.fused_qkv or proj == "o":
            return slice(None)
        shape = self.shape(config)
        q, kv = shape.H * shape.D, shape.kv_width
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[proj]

    def linear(self, attention: nn.Module, proj: str, config: PretrainedConfig) -> LinearPart:
        """``proj``'s weight and bias in ``attention`` (views: rows of a fused projection)."""
        module = getattr(attention, getattr(self, f"{proj}_name"))
        rows = self.rows(config, proj)
        return LinearPart(module.weight[rows], None if module.bias is None else module.bias[rows])

    def rotary_embedding(self, config: PretrainedConfig) -> nn.Module:
        """A fresh rotary embedding built from the config (theta, scaling and type come from it)."""
        if self.rotary is None:
            raise ValueError(f"{self.model_type} has no rotary embedding")
        module, name = self.rotary.split(":")
        return getattr(importlib.import_module(module), name)(config=config)

    def scaling(self, config: PretrainedConfig) -> float:
        """The softmax scale of the attention scores."""
        if self.scaling_field is None:
            return self.shape(config).D ** -0.5
        return getattr(config, self.scaling_field) ** -0.5

    def qk_norms(self, config: PretrainedConfig) -> tuple[nn.Module, nn.Module] | None:
        """Fresh (q_norm, k_norm) per-head norms built from the config, or None without QK-norm."""
        if self.qk_norm is None:
            return None
        module, name = self.qk_norm.split(":")
        cls = getattr(importlib.import_module(module), name)
        D = self.shape(config).D
        return cls(D, eps=config.rms_norm_eps), cls(D, eps=config.rms_norm_eps)

    def attention_kwargs(self, config: PretrainedConfig, layer_idx: int) -> dict:
        """Extra keyword arguments the original attention hands to the attention interface."""
        if self.sliding_window == "all":
            return {"sliding_window": getattr(config, "sliding_window", None)}
        if self.sliding_window == "layer_types":
            sliding = config.layer_types[layer_idx] == "sliding_attention"
            return {"sliding_window": config.sliding_window if sliding else None}
        return {}


ADAPTERS: dict[str, ArchAdapter] = {
    "llama": ArchAdapter(model_type="llama"),
    "mistral": ArchAdapter(
        model_type="mistral",
        rotary="transformers.models.mistral.modeling_mistral:MistralRotaryEmbedding",
        sliding_window="all",
    ),
    "qwen2": ArchAdapter(
        model_type="qwen2",
        rotary="transformers.models.qwen2.modeling_qwen2:Qwen2RotaryEmbedding",
        sliding_window="layer_types",
    ),
    "qwen3": ArchAdapter(
        model_type="qwen3",
        rotary="transformers.models.qwen3.modeling_qwen3:Qwen3RotaryEmbedding",
        sliding_window="layer_types",
        qk_norm="transformers.models.qwen3.modeling_qwen3:Qwen3RMSNorm",
    ),
    "phi3": ArchAdapter(
        model_type="phi3",
        q_name="qkv_proj",
        k_name="qkv_proj",
        v_name="qkv_proj",
        rotary="transformers.models.phi3.modeling_phi3:Phi3RotaryEmbedding",
        sliding_window="all",
        fused_qkv=True,
    ),
    "gemma3_text": ArchAdapter(
        model_type="gemma3_text",
        rotary="transformers.models.gemma3.modeling_gemma3:Gemma3RotaryEmbedding",
        sliding_window="layer_types",
        qk_norm="transformers.models.gemma3.modeling_gemma3:Gemma3RMSNorm",
        qk_norm_offset=1.0,  # Gemma's RMSNorm scales by 1 + weight
        scaling_field="query_pre_attn_scalar",
        rope_per_layer_type=True,
    ),
    "opt": ArchAdapter(
        model_type="opt",
        layers_path="model.decoder.layers",
        o_name="out_proj",
        rotary=None,
    ),
}


def get_adapter(config: PretrainedConfig) -> ArchAdapter:
    """The adapter for ``config.model_type``; a clear error naming the supported families otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"lrkv does not support model_type {model_type!r} yet; supported: {', '.join(sorted(ADAPTERS))}"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise UnsupportedModelError(
            f"lrkv does not support attention logit softcapping yet ({model_type} with "
            f"attn_logit_softcapping {softcap})"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"lrkv supports causal attention only ({model_type} is bidirectional)")
    return ADAPTERS[model_type]
