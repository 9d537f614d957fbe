"""Start an N x T pool of local processes (gloo on CPU) when not under torchrun.

Used by the main job with no arguments and by the multi-process tests. Every worker's
result comes back in rank order; a worker that raises fails the whole launch with its
traceback, and a pool that does not finish within ``timeout_s`` (a hung collective) is
killed and reported as a failure. :func:`supervise` runs a pool that serves until stopped
(the server): it forwards stop signals and tears the pool down when a rank dies.
"""

from __future__ import annotations

import io
import os
import queue
import random
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["end_tool_process", "exit_with", "forkserver_context", "free_port", "init_distributed",
           "init_tool_process", "run_ranks", "spawn", "supervise", "PoolFailure"]


class PoolFailure(RuntimeError):
    """A worker raised, died, or the pool timed out."""


def free_port() -> int:
    """A port free now, for a server that binds it itself later (an HTTP port, torchrun's
    rendezvous endpoint); a pool's rendezvous never uses one (see :func:`_rendezvous`).

    Until the server binds it, another process may take it. Within the kernel's ephemeral
    range any outgoing connection of any process can (a busy machine opens hundreds), so
    where that range is known the port comes from below it, where only another explicit
    bind can: picked at random, then checked free."""
    low = _ephemeral_range()[0]
    rng = random.SystemRandom()
    for _ in range(64 if low > _LOWEST_PORT + 1000 else 0):
        port = rng.randrange(_LOWEST_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LOWEST_PORT = 10000  # above the well-known and most registered services' ports


def _ephemeral_range() -> Tuple[int, int]:
    """The ports the kernel lends to outgoing connections (Linux; else none known)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 0, 0


def init_tool_process(device_type: str) -> torch.device:
    """A command-line tool's process group: under torchrun its rank, else a world of one;
    NCCL on ``cuda`` (the device of ``LOCAL_RANK``, made current), gloo on ``cpu``. Returns
    the device."""
    device = torch.device("cpu")
    if device_type == "cuda":
        if not torch.cuda.is_available():  # one line, exit 2, before any process group
            import sys

            print(f"{os.path.basename(sys.argv[0])}: error: --device cuda: no CUDA device on this machine",
                  file=sys.stderr)
            raise SystemExit(2)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" not in os.environ:  # one process without torchrun: a world of one, no port
        os.environ.update(RANK="0", WORLD_SIZE="1")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    return device


def end_tool_process(device: torch.device) -> int:
    """The end of a tool started by :func:`init_tool_process`, once its results are written:
    on a GPU exit at once (NCCL's teardown can hang), else destroy the group; returns 0."""
    import sys

    sys.stdout.flush()
    if device.type == "cuda":
        os._exit(0)
    dist.destroy_process_group()
    return 0


def exit_with(main: Callable[[], int]) -> None:
    """A console entry point: ``main()``, output flushed, then exit at once with its code,
    skipping the interpreter's teardown (NCCL's, or an engine's worker processes', can hang
    after the results are written)."""
    import sys

    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_distributed(backend: str, rank: int, world_size: int, timeout_s: float = 120.0,
                     store_port: Optional[int] = None) -> None:
    """``init_process_group`` with a collective timeout: from MASTER_ADDR / MASTER_PORT
    (torchrun's rendezvous), or joining a local pool's store on ``store_port`` (see
    :func:`_rendezvous`)."""
    store = None
    if store_port is not None:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _rendezvous(timeout_s: float) -> "dist.TCPStore":
    """A local pool's rendezvous: the store's server, held by the launching process for the
    pool's life, on a port the OS picks as it binds (port 0). Picking a free port first and
    letting rank 0 bind it later leaves a window in which another process (a parallel test,
    a server) can take it, and the pool then fails to start."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _to_bytes(value: Any) -> bytes:
    """Serialise a result (tensors included) so it outlives the worker's shared memory."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# What a pool's processes import before anything else: loaded once in the forkserver,
# then every worker starts from a fork of it instead of importing torch and Megatron-Core
# again (about 4 s of CPU per process on a 2-core machine); the last entry freezes what
# they made (tknp_megatron/forkserver_heap.py).
PRELOAD = ("tknp_megatron", "torch", "torch.distributed", "megatron.core", "tknp_megatron.engine.factory",
           "tknp_megatron.forkserver_heap")


UNIX_PATH_MAX = 108  # bytes of a Unix socket's address on Linux, its final NUL included


def forkserver_context(preload: Sequence[str]):
    """A multiprocessing context whose processes are forks of a clean server process that
    imported ``preload`` once (never forks of the caller, so no threads or CUDA state are
    inherited): ``forkserver``. ``spawn`` instead where the platform has no forkserver, or
    where the server's socket would not fit a Unix socket's address: it lies under
    ``$TMPDIR``, which a launcher or a test runner may set deep, and binding it would fail."""
    from multiprocessing.connection import arbitrary_address

    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    listener = arbitrary_address("AF_UNIX")  # an address as the server picks its own
    if isinstance(listener, str) and len(os.fsencode(listener)) >= UNIX_PATH_MAX:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def _context():
    """The pools' multiprocessing context (:func:`forkserver_context` with :data:`PRELOAD`)."""
    return forkserver_context(PRELOAD)


def _enter(env: Tuple[dict, str]) -> None:
    """A worker's environment and working directory: the caller's at launch (a
    forkserver's children otherwise keep the server's, from when it started)."""
    os.environ.clear()
    os.environ.update(env[0])
    os.chdir(env[1])


def _worker(rank, world_size, port, fn, args, results, timeout_s, env):
    _enter(env)
    torch.set_num_threads(1)
    try:
        init_distributed("gloo", rank, world_size, timeout_s, store_port=port)
        out = fn(rank, world_size, *args)
        results.put((rank, True, _to_bytes(out)))
    except BaseException:  # report every failure to the parent, then exit
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 240.0,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be importable (module level). Returns the per-rank return values.
    Raises :class:`PoolFailure` on the first worker error, on a worker that exits without a
    result, or on timeout.
    """
    ctx = _context()
    results = ctx.Queue()
    store = _rendezvous(timeout_s)  # held here until the pool ends
    port = store.port
    env = (dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, tuple(args), results, timeout_s, env),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout_s
    silent_before: List[int] = []
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # a rank that exited unreported (killed, or dead before its function ran)
                # fails the pool now, not at the timeout: seen on two empty polls a
                # second apart, so a report it sent as it exited has been read first
                silent = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if silent and silent == silent_before:
                    raise PoolFailure(f"rank {silent[0]} of {world_size} exited with code "
                                      f"{procs[silent[0]].exitcode} and no result (ranks done: {sorted(out)})")
                silent_before = silent
                if time.monotonic() > deadline:
                    raise PoolFailure(
                        f"pool of {world_size} timed out after {timeout_s:.0f}s "
                        f"(ranks done: {sorted(out)})"
                    ) from None
                continue
            if not ok:
                raise PoolFailure(f"rank {rank} failed:\n{value}")
            out[rank] = _from_bytes(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def run_ranks(fn: Callable[..., Any], args: Any, device: str, world: int,
              timeout_s: float = 1800.0) -> Tuple[int, Any]:
    """A tool's pool: ``fn(rank, world_size, args)`` on this process's rank under torchrun
    (NCCL on ``cuda``, binding LOCAL_RANK's GPU first; gloo on ``cpu``), else in a local
    gloo pool of ``world`` processes. Returns ``(rank, result)``: this rank's result under
    torchrun (the process group stays up for the caller), rank 0's otherwise.
    """
    if "RANK" not in os.environ:
        return 0, spawn(fn, world, (args,), timeout_s=timeout_s)[0]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    init_distributed("nccl" if device == "cuda" else "gloo", rank, size, timeout_s)
    return rank, fn(rank, size, args)


def _serving_worker(rank, world_size, port, fn, args, timeout_s, env):
    _enter(env)
    torch.set_num_threads(1)
    init_distributed("gloo", rank, world_size, timeout_s, store_port=port)
    fn(rank, world_size, *args)  # an exception exits the process with status 1


def supervise(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
              timeout_s: float = 600.0, grace_s: float = 30.0) -> int:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes until they end.

    SIGTERM or SIGINT here is passed to every rank (they stop in order). When a rank exits
    with an error the others get SIGTERM; whatever still runs ``grace_s`` after a stop or
    a failure is killed. Returns 0 when every rank exited cleanly, else 1.
    """
    import signal

    ctx = _context()
    store = _rendezvous(timeout_s)  # held here until the pool ends
    port = store.port
    env = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_serving_worker, args=(r, world_size, port, fn, tuple(args), timeout_s, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = [None]

    def stop(*_):
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: the ranks' own handlers stop in order
        if deadline[0] is None:
            deadline[0] = time.monotonic() + grace_s

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while any(p.is_alive() for p in procs):
            if deadline[0] is None and any(p.exitcode not in (None, 0) for p in procs):
                stop()
            if deadline[0] is not None and time.monotonic() > deadline[0]:
                for p in procs:
                    if p.is_alive():
                        p.kill()
            time.sleep(0.1)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for p in procs:
            p.join(5)
    return 0 if all(p.exitcode == 0 for p in procs) else 1
