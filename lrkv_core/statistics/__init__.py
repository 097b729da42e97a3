"""Calibration statistics: one file per statistic, one registry, one file format.

Add a statistic: a new file here with a frozen dataclass ``@STATISTICS.register``-ed whose ``collect``
returns one value per layer, and its import below; methods that read it name it in their ``needs``.
"""

from . import attention_gram, fisher, gram, layer_error, output_fisher, response  # noqa: F401  (registration)
from .attention_gram import AttentionGram, collect_attention_gram
from .base import STATISTICS, LayerValue, Statistic, load_statistic, read_header, save_statistic
from .fisher import Fisher, collect_fisher
from .gram import Gram, collect_gram
from .layer_error import LayerOutputError, collect_layer_output_error
from .output_fisher import OutputFisher, collect_output_fisher
from .response import KLResponse, collect_kl_response

__all__ = [
    "STATISTICS",
    "AttentionGram",
    "Fisher",
    "Gram",
    "KLResponse",
    "LayerOutputError",
    "OutputFisher",
    "LayerValue",
    "Statistic",
    "collect_attention_gram",
    "collect_fisher",
    "collect_gram",
    "collect_kl_response",
    "collect_layer_output_error",
    "collect_output_fisher",
    "load_statistic",
    "read_header",
    "save_statistic",
]
