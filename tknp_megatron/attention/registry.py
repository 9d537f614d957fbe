"""Attention backends by name: register, list the usable ones, build one.

A backend is registered with a factory, an ``available()`` check (its dependencies
import) and a ``supports(device)`` check (it can run on that device). Names are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

import torch

from tknp_megatron.attention.base import AttentionBackend

__all__ = ["register_backend", "get_backend", "available_backends", "backend_problem", "default_backend_name"]

DeviceLike = Union[torch.device, str, None]


@dataclass(frozen=True)
class _Entry:
    factory: Callable[..., AttentionBackend]
    available: Callable[[], bool]
    supports: Callable[[torch.device], bool]


_REGISTRY: Dict[str, _Entry] = {}


def _device(device: DeviceLike) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def register_backend(
    name: str,
    factory: Callable[..., AttentionBackend],
    available: Callable[[], bool],
    supports: Optional[Callable[[torch.device], bool]] = None,
) -> None:
    """Register ``factory(**options) -> AttentionBackend`` under ``name``.

    Args:
        name: exact backend name (re-registering a name replaces it).
        factory: builds a backend; receives the keyword options given to :func:`get_backend`.
        available: cheap check that the backend's dependencies are importable.
        supports: whether the backend runs on a device (default: every device).
    """
    _REGISTRY[name] = _Entry(factory, available, supports or (lambda device: True))


def _usable(entry: _Entry, device: torch.device) -> bool:
    try:
        return _importable(entry) and bool(entry.supports(device))
    except Exception:  # a broken optional dependency must not break the others
        return False


def available_backends(device: DeviceLike = None) -> List[str]:
    """Names of the registered backends usable on ``device`` (default CPU), sorted."""
    dev = _device(device)
    return sorted(name for name, entry in _REGISTRY.items() if _usable(entry, dev))


def backend_problem(name: Optional[str], device: DeviceLike = None) -> Optional[str]:
    """Why the backend ``name`` cannot run on ``device``, in one line naming the ones that
    can; None when it can (or ``name`` is None: the device's default). For command lines,
    to refuse before any process starts.

    On a CUDA device only what needs no CUDA context is checked (the name, the library):
    under torchrun every rank parses its arguments before it picks its GPU, and asking a
    device's capability there would open a context on GPU 0 in each of them. Whether the
    GPU runs it (FA3 needs Hopper) is checked when the engine builds the backend."""
    if name is None:
        return None
    dev = _device(device)
    if dev.type == "cuda":
        usable = sorted(n for n, e in _REGISTRY.items() if _importable(e))
    else:
        usable = available_backends(dev)
    if name in usable:
        return None
    return f"{name}: not usable on {dev}; choose one of {', '.join(usable)}"


def _importable(entry: _Entry) -> bool:
    try:
        return bool(entry.available())
    except Exception:  # a broken optional dependency must not break the others
        return False


def default_backend_name(device: DeviceLike = None) -> str:
    """``"auto"`` (the faster of FA3 and the Triton kernel per call, Triton where FA3 is
    not there) on CUDA when usable there, else ``"torch"``."""
    dev = _device(device)
    if dev.type == "cuda" and "auto" in _REGISTRY and _usable(_REGISTRY["auto"], dev):
        return "auto"
    return "torch"


def get_backend(name: Optional[str], device: DeviceLike = None, **options) -> AttentionBackend:
    """Build the backend ``name`` for ``device``; ``None`` picks :func:`default_backend_name`.

    Raises:
        ValueError: ``name`` is unknown or unusable on ``device``; the message lists the
            usable ones.
    """
    dev = _device(device)
    name = default_backend_name(dev) if name is None else name
    entry = _REGISTRY.get(name)
    if entry is None or not _usable(entry, dev):
        why = "unknown" if entry is None else f"not available on {dev}"
        raise ValueError(
            f"attention backend {name!r} is {why}; available on {dev}: {available_backends(dev)}"
        )
    return entry.factory(**options)
