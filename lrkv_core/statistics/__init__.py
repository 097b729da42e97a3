"""Calibration statistics: one file per statistic, one registry, one file format.

Add a statistic: a new file here with a frozen dataclass ``@STATISTICS.register``-ed whose ``accumulate``
returns per-layer sums that add up across shards of the rows and whose ``finish`` turns the sums over all
rows into one value per layer, and its import below; methods that read it name it in their ``needs``.
``collect`` (all rows), ``collect_shard`` and ``merge`` (a map over shards and its reduce) follow.
"""

from . import attention_gram, fisher, gram, layer_error, output_fisher, response  # noqa: F401  (registration)
from .attention_gram import AttentionGram, collect_attention_gram
from .base import (
    STATISTICS,
    LayerValue,
    Partial,
    Statistic,
    load_partial,
    load_statistic,
    read_header,
    save_partial,
    save_statistic,
    shard_span,
)
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
    "Partial",
    "Statistic",
    "collect_attention_gram",
    "collect_fisher",
    "collect_gram",
    "collect_kl_response",
    "collect_layer_output_error",
    "collect_output_fisher",
    "load_partial",
    "load_statistic",
    "read_header",
    "save_partial",
    "save_statistic",
    "shard_span",
]
