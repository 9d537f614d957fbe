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
