"""Starting a pool's processes (``tknp_megatron.launch``) where ``$TMPDIR`` is deep.

A forkserver listens on a Unix socket under ``$TMPDIR``, whose address holds at most 107
bytes on Linux; launchers and test runners (torchrun's per-host directories, pytest's
per-test ones) can set it deeper than that, where binding the socket fails. The pools then
start their processes with ``spawn``, and work the same.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def _rank_sum(rank: int, world: int) -> int:
    """Every rank's ``rank + 1``, summed over the group (gloo)."""
    import torch

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def _start(tmpdir: Path) -> list:
    """A 2-process pool started under ``TMPDIR=tmpdir``: the start method and each rank's sum."""
    code = ("from tknp_megatron.launch import forkserver_context, spawn\n"
            "from tests.test_launch import _rank_sum\n"
            "print(forkserver_context(()).get_start_method())\n"
            "print(spawn(_rank_sum, 2, timeout_s=120))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmpdir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_a_pool_starts_where_tmpdir_is_too_deep_for_a_forkserver_socket(tmp_path):
    deep = tmp_path / ("d" * 50) / ("e" * 50)
    deep.mkdir(parents=True)
    assert len(str(deep)) > 107
    assert _start(deep) == ["spawn", "[3,", "3]"]


def test_a_pool_starts_from_a_forkserver_where_it_fits():
    short = Path("/tmp")
    assert _start(short) == ["forkserver", "[3,", "3]"]


def test_a_pool_starts_while_the_port_free_port_names_is_taken(monkeypatch):
    """A pool's rendezvous is bound by the OS as it is chosen, never picked free and bound
    later: with every port that ``free_port`` would name already taken (as a parallel test
    or a server can take it in between), the pool still starts."""
    import socket

    from tknp_megatron import launch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1])
        assert launch.spawn(_rank_sum, 2, timeout_s=60) == [3, 3]


def _exit_at_once(rank: int, world: int) -> None:
    """Rank 1 dies without a word (as a killed process does) while rank 0 is busy for longer
    than the test waits."""
    import os
    import time

    if rank == 1:
        os._exit(3)
    time.sleep(90)


def test_a_rank_that_dies_unreported_fails_the_pool_at_once():
    import time

    import pytest

    from tknp_megatron.launch import PoolFailure, spawn

    start = time.monotonic()
    with pytest.raises(PoolFailure, match="rank 1 of 2 exited with code 3 and no result"):
        spawn(_exit_at_once, 2, timeout_s=120)
    assert time.monotonic() - start < 60


def test_a_free_port_for_a_server_lies_below_the_ephemeral_range():
    """Outgoing connections borrow ports from the kernel's ephemeral range, so a port picked
    there for a server to bind later can be taken first; free_port picks below it."""
    import socket

    from tknp_megatron.launch import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    assert 0 < low < high  # Linux: the CI's machines and this one
    ports = {free_port() for _ in range(8)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))  # free, as promised


def test_megatron_core_imports_without_torch_compile_where_torch_has_no_gpu_build():
    """A process that imports the library first imports Megatron-Core with its ``jit_fuser``
    the identity where torch was built without CUDA (no TorchDynamo or Inductor imported;
    torch's own ``torch.compile`` back afterwards), and untouched where torch has CUDA."""
    import torch

    code = ("import sys, torch, tknp_megatron, megatron.core.jit as jit\n"
            "import tknp_megatron.engine.factory, tknp_megatron.models.reference\n"
            "f = lambda x: x\n"
            "print(jit.jit_fuser(f) is f, 'torch._dynamo' in sys.modules, torch.compile.__module__)\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    uncompiled, dynamo, module = proc.stdout.split()
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert (uncompiled, dynamo) == ("True", "False")
    else:
        assert uncompiled == "False"
    assert module == "torch"
