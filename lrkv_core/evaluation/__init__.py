"""Evaluation through the deployed cache: short windows, long contexts, retrieval, and serving speed.

Perplexity, KV bytes and KL on short windows (:mod:`.metrics`), continuation after a long context
(:mod:`.longcontext`) and the retrieval tasks it generates (:mod:`.needles`), decode and prefill speed
(:mod:`.serving`), and transformers' own quantized cache as the anchor (:mod:`.hf_quantized_cache`).
"""
