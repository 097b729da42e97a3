"""Running the kernels in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors): how they are tested
without a GPU.

The interpreter turns a scalar into an index with ``int(array)``, which numpy ≥ 2.4 refuses for the
one-element arrays it keeps scalars in, so a kernel whose loop has a run-time trip count fails there
(compiled kernels are unaffected). :func:`read_scalars_as_indices` makes it read the element instead.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def read_scalars_as_indices() -> None:
    """Patch Triton's interpreter (once) so run-time loop bounds work with any numpy; a no-op unless the
    interpreter is on."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
