"""Host <-> GPU copies that never wait for more GPU work than they must.

A step's inputs are a dozen tiny tensors. Copying each from pageable memory makes the
host wait for the GPU stream every time, which would stall a host that plans step
n + 1 while step n still runs. Here they are packed into one pinned buffer per dtype
and copied with ``non_blocking=True``: the host returns at once, the copy runs in stream
order, and torch's pinned-memory cache keeps each buffer alive until its copy is done.

The other way, ``tensor.tolist()`` would synchronise the whole stream, i.e. wait for
step n + 1 as well when the host only wants step n's tokens. :class:`HostCopy` copies
into pinned memory behind step n and waits on an event recorded right after it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["HostCopy", "Packed", "StaticInputs", "pack", "to_device"]


def _groups(tensors: Sequence) -> Dict[object, List[int]]:
    """Indices of ``tensors`` by dtype, in order of first appearance."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return by_dtype


def _pinned(tensors: Sequence[torch.Tensor], idx: List[int]) -> torch.Tensor:
    """The tensors ``idx`` (one dtype) back to back in one pinned host buffer."""
    flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=tensors[idx[0]].dtype, pin_memory=True)
    torch.cat([tensors[i].reshape(-1) for i in idx], out=flat)
    return flat


def _views(flat: torch.Tensor, tensors: Sequence[torch.Tensor], idx: List[int], out: list) -> None:
    for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
        out[i] = piece.view(tensors[i].shape)


@dataclass(frozen=True)
class Packed:
    """Host tensors built back to back in one buffer per dtype (:func:`pack`)."""

    flats: Tuple[torch.Tensor, ...]
    """One 1-D buffer per dtype, in order of first appearance (as :class:`StaticInputs` groups)."""
    layout: Tuple[Tuple[int, int, Tuple[int, ...]], ...]
    """Each tensor's ``(buffer, offset, shape)``, in order."""

    def views(self) -> List[torch.Tensor]:
        """The tensors, in order, as views into :attr:`flats`."""
        return [self.flats[b][o: o + math.prod(shape)].view(shape) for b, o, shape in self.layout]


def pack(arrays: Sequence[np.ndarray], pin: bool = False) -> Packed:
    """Numpy arrays -> :class:`Packed`: each dtype's arrays written once into their own
    buffer (pinned with ``pin``: a GPU host, whose copy then needs no staging), so that the
    crossing to the device is one copy per dtype with no packing step of its own."""
    flats: List[torch.Tensor] = []
    layout: List[Tuple[int, int, Tuple[int, ...]]] = [None] * len(arrays)  # type: ignore[list-item]
    for b, idx in enumerate(_groups(arrays).values()):
        flat = torch.empty(sum(arrays[i].size for i in idx), dtype=_torch_dtype(arrays[idx[0]].dtype),
                           pin_memory=pin)
        host, offset = flat.numpy(), 0
        for i in idx:  # slice assignment: cheaper than np.concatenate for a dozen short arrays
            n = arrays[i].size
            host[offset: offset + n] = arrays[i].reshape(-1)
            layout[i] = (b, offset, arrays[i].shape)
            offset += n
        flats.append(flat)
    return Packed(tuple(flats), tuple(layout))


@functools.lru_cache(maxsize=None)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """Host tensors -> the same tensors on ``device`` (same shapes and dtypes, in order).

    On CPU the tensors are returned as they are (no copy).
    """
    if device.type != "cuda":
        return list(tensors)
    out: List[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for idx in _groups(tensors).values():
        _views(_pinned(tensors, idx).to(device, non_blocking=True), tensors, idx, out)
    return out


class StaticInputs:
    """Fixed device buffers shaped like a list of host tensors, refilled each step with one
    non-blocking copy per dtype (a CUDA graph's inputs: their addresses never change).

    Args:
        like: host tensors giving the shapes and dtypes (and the first contents).
        device: where the buffers live (on CPU the views are the host tensors' copies).
    """

    def __init__(self, like: Sequence[torch.Tensor], device: torch.device):
        self._groups = list(_groups(like).values())
        self._flats = []
        views: List[torch.Tensor] = [None] * len(like)  # type: ignore[list-item]
        for idx in self._groups:
            flat = torch.cat([like[i].reshape(-1) for i in idx]).to(device)
            self._flats.append(flat)
            _views(flat, like, idx, views)
        self.views = views

    def copy_(self, tensors: Sequence[torch.Tensor] | Packed) -> None:
        """Refill from host ``tensors`` of the same shapes and dtypes (stream-ordered); from
        :class:`Packed` tensors, each dtype's buffer crosses as it is."""
        if isinstance(tensors, Packed):
            if len(tensors.flats) != len(self._flats):
                raise ValueError(f"packed inputs of {len(tensors.flats)} dtypes for {len(self._flats)} buffers")
            for src, flat in zip(tensors.flats, self._flats):
                if src.numel() != flat.numel() or src.dtype != flat.dtype:
                    raise ValueError(f"packed inputs of {src.numel()} {src.dtype} values for a buffer of "
                                     f"{flat.numel()} {flat.dtype}")
                flat.copy_(src if flat.device.type != "cuda" or src.is_pinned() else src.pin_memory(),
                           non_blocking=True)
            return
        for idx, flat in zip(self._groups, self._flats):
            if flat.device.type == "cuda":
                flat.copy_(_pinned(tensors, idx), non_blocking=True)
            else:  # the same packing, straight into the buffer
                torch.cat([tensors[i].reshape(-1) for i in idx], out=flat)


class HostCopy:
    """A device tensor's copy to the host, started now, read later.

    Args:
        tensor: the device tensor (on CPU, it is kept as it is).
    """

    def __init__(self, tensor: torch.Tensor):
        self._event: Optional[torch.cuda.Event] = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> torch.Tensor:
        """The host tensor, once the work queued before the copy is done (not later work)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
