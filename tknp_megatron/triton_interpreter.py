"""Triton's CPU interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels on CPU)
made to run them under Triton 3.6 with a recent NumPy.

The interpreter holds every scalar as a one-element array, and Triton 3.6 takes a scalar's
``__index__`` (a loop bound: ``range(kv_lo, kv_hi, BLOCK_N)``) as ``int(array)``, which NumPy
refuses for an array of one dimension (2.4 does; earlier releases warned). Triton 3.7
converts ``array.squeeze()`` instead; torch 2.11 pins Triton 3.6, so a GPU machine's own
torch runs the CPU tests with the older interpreter. :func:`install` gives an interpreter before 3.7 that conversion (the
same value under any NumPy), and changes nothing under a newer Triton or compiled kernels.
"""

from __future__ import annotations

import os

__all__ = ["install"]


def install() -> None:
    """Under ``TRITON_INTERPRET=1``, before a kernel runs (each kernel module calls it)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import triton
    from triton.runtime import interpreter

    try:
        if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7):
            return
    except ValueError:  # a version string of another form: a build of its own, left as it is
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
