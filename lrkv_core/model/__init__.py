"""A model and its compressed form: architecture facts, latent attention, fusing the factors, the saved
format.

Loading originals (:mod:`.loading`), the per-architecture table (:mod:`.adapters`), the attention modules
whose cache holds latents (:mod:`.attention`, :mod:`.attention_norope`), fusing factors into a model
(:mod:`.fuse`), saving and loading a compressed model directory (:mod:`.io`) and transformers' quantizer hook
that makes ``from_pretrained`` load one (:mod:`.hf_quantizer`).
"""
