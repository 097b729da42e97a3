"""lrkv_demo: lrkv's embedded demo model, ``builtin:pydoc-llama``, and the ``builtin:`` references to it.

A small Llama trained in about two minutes on the Python stdlib's docstrings (:mod:`.builtin`, with its
corpus and tokenizer in :mod:`.corpus`), so the quickstart runs offline. :mod:`.refs` plugs the
``builtin`` scheme into lrkv_core's resolver through entry points (``lrkv.model_refs`` and
``lrkv.dataset_refs``); lrkv_core never imports this package.
"""

from .builtin import BUILTIN_MODELS, DEFAULT_BUILTIN, BuiltinSpec, build_builtin_model, ensure_builtin_model

__all__ = ["BUILTIN_MODELS", "DEFAULT_BUILTIN", "BuiltinSpec", "build_builtin_model", "ensure_builtin_model"]
