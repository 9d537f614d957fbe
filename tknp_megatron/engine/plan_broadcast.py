"""The coordinator's step plans to the rest of the pool, host to host, one collective a step.

``torch.distributed.broadcast_object_list`` runs two collectives per call (the pickle's
size, then its bytes), each a round over the pool's gloo group. Here the pool keeps a
fixed host buffer: an 8-byte length, then the pickle, broadcast whole, so a plan that fits
costs one collective. A larger object (a step admitting many requests) sends its length in
the buffer and its bytes in a second collective, and every rank grows the buffer to fit
objects of that size from then on (up to :data:`MAX_CAPACITY`, so a one-off large object,
such as a run's results, does not make every later step send megabytes).
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["PlanBroadcast", "INITIAL_CAPACITY", "MAX_CAPACITY"]

INITIAL_CAPACITY = 16 << 10
"""Payload bytes the buffer starts with (a 64-request decode plan pickles to about 5 KB)."""

MAX_CAPACITY = 1 << 20
"""Largest payload the buffer grows to."""

_HEADER = 8  # int64 payload length


class PlanBroadcast:
    """Pickled objects from ``src`` to every rank of ``group`` (gloo, host memory).

    Every rank of the group calls :meth:`__call__` in the same order; ``src`` passes the
    object, the others receive it.

    Args:
        group: the pool's gloo group.
        src: the sending rank (global rank).
        capacity: initial payload bytes of the fixed buffer.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], src: int, capacity: int = INITIAL_CAPACITY):
        self.group, self.src = group, src
        self.is_src = dist.get_rank() == src
        self._buffer = torch.zeros(_HEADER + capacity, dtype=torch.uint8)
        self.collectives = 0  # broadcasts issued so far (one per object that fits)

    @property
    def capacity(self) -> int:
        return self._buffer.numel() - _HEADER

    def __call__(self, obj: Any = None, grow: bool = True) -> Any:
        """Broadcast ``obj`` (on ``src``); every rank returns the object. ``grow=False``:
        an object too large for the buffer does not grow it (a one-off, such as results)."""
        buf = self._buffer.numpy()
        data = b""
        if self.is_src:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            buf[:_HEADER].view(np.int64)[0] = len(data)
            if len(data) <= self.capacity:
                buf[_HEADER : _HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._broadcast(self._buffer)
        size = int(buf[:_HEADER].view(np.int64)[0])
        if size <= self.capacity:
            payload = buf[_HEADER : _HEADER + size]
        else:  # too large for the buffer: its bytes in a second collective
            big = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()) if self.is_src else (
                torch.empty(size, dtype=torch.uint8))
            self._broadcast(big)
            payload = big.numpy()
            if grow and size <= MAX_CAPACITY:  # every rank knows the size: all grow alike
                self._buffer = torch.zeros(_HEADER + _next_power_of_two(size), dtype=torch.uint8)
        if self.is_src:
            return obj
        return pickle.loads(memoryview(payload))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self.src, group=self.group)
        self.collectives += 1


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
