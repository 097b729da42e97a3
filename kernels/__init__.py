"""lrkv_kernels: fused operators for latent KV caches, each beside its torch reference.

Every operator lives in its own sub-package: ``reference.py`` (torch only, the spec) and a dispatcher in
``__init__.py`` that picks an implementation. This package never imports lrkv_core.
"""
