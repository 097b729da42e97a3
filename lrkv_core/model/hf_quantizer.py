"""Plain ``AutoModelForCausalLM.from_pretrained(dir)`` for lrkv models, through transformers' quantizer hook.

transformers lets a package register its own quantization method (``quant_method`` in config.json plus an
``HfQuantizer``): that is how compressed-tensors models load without remote code. A compressed model's
config.json carries ``quantization_config: {"quant_method": "lrkv"}`` next to its ``lrkv`` section; once
``lrkv_core`` is imported, ``from_pretrained`` finds :class:`LrkvHfQuantizer`, which swaps in the latent
attention modules while the model is still an empty skeleton, so every checkpoint tensor lands in its
place and the model comes back with the latent cache on. :func:`lrkv_core.load_compressed` remains the
strict loader (it refuses a checkpoint with any missing or unexpected tensor).
"""

from __future__ import annotations

from typing import Any

from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..format import forget_weights_checksum
from .fuse import build_latent_skeleton

QUANT_METHOD = "lrkv"


class LrkvConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of an lrkv model: a marker; the ranks live in the ``lrkv`` section."""

    def __init__(self, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD


class LrkvHfQuantizer(HfQuantizer):
    """Builds the latent attention skeleton before the weights are loaded; quantizes nothing on the fly."""

    requires_calibration = True  # a model becomes an lrkv model by `lrkv convert`, not in from_pretrained

    def _process_model_before_weight_loading(self, model, **kwargs):
        if not getattr(model.config, "lrkv", None):
            raise ValueError(
                "config.json has quantization_config.quant_method 'lrkv' but no 'lrkv' section: "
                "the directory was not written by lrkv_core.save_compressed"
            )

        build_latent_skeleton(model)
        forget_weights_checksum(model.config)  # this loader does not check it; a re-save must not keep it
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Register the ``lrkv`` quant method with transformers (idempotent: importing twice is fine)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(LrkvConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(LrkvHfQuantizer)


register()
