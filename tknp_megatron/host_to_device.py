"""Small host tensors to the GPU in one transfer per dtype, without a host sync.

A step's inputs are a dozen tiny tensors. Copying each from pageable memory makes the
host wait for the GPU stream every time, which would stall a host that plans step
n + 1 while step n still runs. Here they are packed into one pinned buffer per dtype
and copied with ``non_blocking=True``: the host returns at once, the copy runs in stream
order, and torch's pinned-memory cache keeps each buffer alive until its copy is done.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

__all__ = ["to_device"]


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """Host tensors -> the same tensors on ``device`` (same shapes and dtypes, in order).

    On CPU the tensors are returned as they are (no copy).
    """
    if device.type != "cuda":
        return list(tensors)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: List[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx]).pin_memory()
        moved = flat.to(device, non_blocking=True)
        for i, piece in zip(idx, moved.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out
