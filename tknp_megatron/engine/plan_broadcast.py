"""Step plans host to host over gloo: to the whole pool in one collective a step
(:class:`PlanBroadcast`), or from one rank to another in one message (:class:`PlanLink`,
PP's stage-to-stage plans).

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

__all__ = ["PlanBroadcast", "PlanLink", "INITIAL_CAPACITY", "MAX_CAPACITY"]

INITIAL_CAPACITY = 16 << 10
"""Payload bytes the buffer starts with (a 64-request decode plan pickles to about 5 KB)."""

MAX_CAPACITY = 1 << 20
"""Largest payload the buffer grows to."""

_HEADER = 8  # int64 payload length


class _Framed:
    """The fixed host buffer both transports send: an int64 payload length, then the pickle
    (when it fits); a larger pickle travels in a second message and grows the buffer."""

    def __init__(self, capacity: int) -> None:
        self._buffer = torch.zeros(_HEADER + capacity, dtype=torch.uint8)

    @property
    def capacity(self) -> int:
        return self._buffer.numel() - _HEADER

    def _pack(self, obj: Any) -> bytes:
        """Pickle ``obj`` into the buffer (its length always, its bytes if they fit)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buf = self._buffer.numpy()
        buf[:_HEADER].view(np.int64)[0] = len(data)
        if len(data) <= self.capacity:
            buf[_HEADER : _HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
        return data

    def _size(self) -> int:
        """The payload length the buffer holds."""
        return int(self._buffer.numpy()[:_HEADER].view(np.int64)[0])

    def _inline(self, size: int) -> memoryview:
        return memoryview(self._buffer.numpy()[_HEADER : _HEADER + size])

    def _grow(self, size: int) -> None:
        """Fit objects of ``size`` bytes from now on (both ends do it alike), up to
        :data:`MAX_CAPACITY`."""
        if size <= MAX_CAPACITY:
            self._buffer = torch.zeros(_HEADER + _next_power_of_two(size), dtype=torch.uint8)


class PlanBroadcast(_Framed):
    """Pickled objects from ``src`` to every rank of ``group`` (gloo, host memory).

    Every rank of the group calls :meth:`__call__` in the same order; ``src`` passes the
    object, the others receive it.

    Args:
        group: the pool's gloo group.
        src: the sending rank (global rank).
        capacity: initial payload bytes of the fixed buffer.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], src: int, capacity: int = INITIAL_CAPACITY):
        super().__init__(capacity)
        self.group, self.src = group, src
        self.is_src = dist.get_rank() == src
        self.collectives = 0  # broadcasts issued so far (one per object that fits)

    def __call__(self, obj: Any = None, grow: bool = True) -> Any:
        """Broadcast ``obj`` (on ``src``); every rank returns the object. ``grow=False``:
        an object too large for the buffer does not grow it (a one-off, such as results)."""
        data = self._pack(obj) if self.is_src else b""
        self._broadcast(self._buffer)
        size = self._size()
        if size <= self.capacity:
            payload = self._inline(size)
        else:  # too large for the buffer: its bytes in a second collective
            big = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()) if self.is_src else (
                torch.empty(size, dtype=torch.uint8))
            self._broadcast(big)
            payload = memoryview(big.numpy())
            if grow:  # every rank knows the size: all grow alike
                self._grow(size)
        if self.is_src:
            return obj
        return pickle.loads(payload)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self.src, group=self.group)
        self.collectives += 1


class PlanLink(_Framed):
    """Pickled objects from one rank to one peer over gloo (host memory), in order.

    The sender's and the receiver's ends are two objects, one on each rank; each message is
    the fixed buffer (length, then the pickle), plus the pickle in a second message when
    it does not fit, after which both ends grow their buffers alike (up to
    :data:`MAX_CAPACITY`). A send does not wait for the receiver: it waits only for the
    previous send from the same end, whose buffer it reuses.

    Args:
        group: a gloo group holding both ranks (the pool's).
        peer: the other end's global rank.
        capacity: initial payload bytes of the fixed buffer.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], peer: int, capacity: int = INITIAL_CAPACITY):
        super().__init__(capacity)
        self.group, self.peer = group, peer
        self._pending: list = []  # works of the send in flight
        self._keep: list = []  # its tensors, alive until it completes
        self.messages = 0  # messages sent or received so far

    def flush(self) -> None:
        """Wait for the send in flight."""
        for work in self._pending:
            work.wait()
        self._pending, self._keep = [], []

    def send(self, obj: Any) -> None:
        """Send ``obj`` to the peer (returns once it is on its way)."""
        self.flush()
        data = self._pack(obj)
        fits = len(data) <= self.capacity
        self._pending.append(dist.isend(self._buffer, self.peer, group=self.group))
        self._keep = [self._buffer]  # the tensors in flight, alive until flush
        if not fits:
            self._keep.append(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()))
            self._pending.append(dist.isend(self._keep[-1], self.peer, group=self.group))
            self._grow(len(data))  # the receiver grows alike; the old buffer stays in _keep
        self.messages += 1 + (not fits)

    def recv(self) -> Any:
        """The peer's next object (blocks until it arrives)."""
        dist.recv(self._buffer, self.peer, group=self.group)
        size = self._size()
        self.messages += 1
        if size <= self.capacity:
            return pickle.loads(self._inline(size))
        big = torch.empty(size, dtype=torch.uint8)
        dist.recv(big, self.peer, group=self.group)
        self.messages += 1
        self._grow(size)
        return pickle.loads(memoryview(big.numpy()))


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
