"""The engine side of Megatron-Core's data-parallel coordinator protocol, for one pool.

Megatron's ``DataParallelInferenceCoordinator`` (a ZMQ ROUTER) waits for one registration
per data-parallel engine, forwards ``SUBMIT_REQUEST [id, prompt, sampling_params]`` to an
engine and relays its ``ENGINE_REPLY`` payloads and the control headers (PAUSE, UNPAUSE,
SUSPEND, RESUME, STOP). Megatron's own ``DynamicInferenceEngine`` registers from its
model-parallel coordinator rank with a DEALER socket named ``mp-coord-<dp rank>`` and an
empty first message; a TKNP pool does the same from its coordinator rank, so several pools
in one world are several data-parallel engines to Megatron. The headers come from the
installed megatron-core (their values differ between versions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence

__all__ = ["CoordinatorLink", "Message", "unbounded_queues"]


def unbounded_queues(sock) -> None:
    """No high-water mark on ``sock``'s queues (ZMQ's default is 1000 messages each way).

    At the mark a ROUTER drops what it sends without a word: Megatron's coordinator relays
    every request of a burst (a chat request with a large ``n`` is that many) to a pool and
    every reply back to its client, so a burst beyond the marks would lose requests that then
    never end. The queues stay bounded by the requests in flight. (libzmq applies the change
    to connections already made, too.)"""
    import zmq

    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


@dataclass(frozen=True)
class Message:
    """One message from the coordinator: its header's name and the fields after it."""

    header: str
    fields: tuple


class CoordinatorLink:
    """A pool coordinator's connection to Megatron's coordinator.

    Args:
        address: the coordinator's ``tcp://host:port``.
        dp_rank: this pool's data-parallel rank (its identity is ``mp-coord-<dp_rank>``).
    """

    def __init__(self, address: str, dp_rank: int):
        import msgpack
        import zmq
        from megatron.core.inference.headers import Headers

        self._zmq, self._msgpack, self._headers = zmq, msgpack, Headers
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, f"mp-coord-{dp_rank}".encode())
        self._socket.setsockopt(zmq.LINGER, 2000)  # replies still queued at close go out
        unbounded_queues(self._socket)  # a burst of requests is never dropped at a mark
        self._socket.connect(address)
        self._socket.send(b"")  # registration, as Megatron's engine sends it
        self.address, self.dp_rank = address, dp_rank

    def receive(self, timeout_ms: int) -> List[Message]:
        """Every message waiting, after up to ``timeout_ms`` for the first (0: don't wait)."""
        out: List[Message] = []
        if timeout_ms > 0 and not self._socket.poll(timeout_ms):
            return out
        while True:
            try:
                raw = self._socket.recv(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                return out
            data = self._msgpack.unpackb(raw, raw=False)
            out.append(Message(self._headers(data[0]).name, tuple(data[1:])))

    def has_header(self, name: str) -> bool:
        """Whether the installed megatron-core defines header ``name`` (e.g. PAUSE_ACK)."""
        try:
            getattr(self._headers, name)
        except AttributeError:
            return False
        return True

    def send(self, name: str, *fields: Any) -> None:
        """Send header ``name`` with ``fields``."""
        header = getattr(self._headers, name)
        self._socket.send(self._msgpack.packb([header.value, *fields], use_bin_type=True))

    def reply(self, items: Sequence[dict]) -> None:
        """Send ended requests (``serialize()``\\ d by megatron-core) in one ENGINE_REPLY."""
        if items:
            self.send("ENGINE_REPLY", list(items))

    def close(self) -> None:
        """Leave the coordinator (DISCONNECT where the version has it) and close."""
        if self.has_header("DISCONNECT"):
            try:
                self.send("DISCONNECT")
            except self._zmq.ZMQError:
                pass
        self._socket.close()
        self._context.term()
