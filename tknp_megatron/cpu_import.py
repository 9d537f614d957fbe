"""Megatron-Core imported without ``torch.compile`` under a torch built without CUDA.

The one CPU shim that has to act before Megatron-Core is imported (the others need its
classes: :mod:`tknp_megatron.models.cpu_shims`). Megatron decorates its fused activations,
norms and bias-dropout-adds with ``megatron.core.jit.jit_fuser``, which is
``torch.compile``; decorating imports TorchDynamo and Inductor, about 3 s of CPU in every
process that imports Megatron-Core (a job's launcher and its forkserver, each tool run).
Where torch has no CUDA (or ROCm) build those functions can only run on CPU, and they run
as written: Megatron's own ``disable_jit_fuser`` makes the same choice. So while
``megatron.core`` itself is first imported, ``torch.compile`` is the identity (Megatron's
``jit_fuser`` takes that value for good); torch's own ``torch.compile`` is restored right
after, and a torch with a GPU build is never touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__all__ = ["install"]


def _uncompiled(model=None, **_):
    """``torch.compile``'s signature, returning what it is given (as a decorator too)."""
    return model if model is not None else (lambda fn: fn)


class _MegatronWithoutCompile(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` as the import system would, and runs its package
    ``__init__`` (which imports the decorated modules) with ``torch.compile`` the identity
    where torch has no GPU build. Removes itself at its first use."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            import torch

            if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
                return run(module)
            compile_ = torch.compile
            torch.compile = _uncompiled
            try:
                run(module)
            finally:
                torch.compile = compile_

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Ahead of the first import of ``megatron.core`` in this process (a no-op once it has
    been imported, or if installed already)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronWithoutCompile) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronWithoutCompile())
