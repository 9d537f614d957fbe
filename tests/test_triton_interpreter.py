"""Triton's CPU interpreter runs the kernels' loops, whose bounds are computed from program
ids (``tknp_megatron/triton_interpreter.py``): under Triton 3.6 with a recent NumPy only with
the fix that module gives it (3.7 and later have it themselves). The kernels themselves run
under the interpreter in ``tests/test_attention.py``, ``tests/test_dcp.py`` and
``tests/test_dense_fusion.py``.

TRITON_INTERPRET is read when a kernel is decorated, so it is set before this file's kernel is.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tknp_megatron import triton_interpreter  # noqa: E402


@triton.jit
def _strided_sum_kernel(X, OUT, n, BLOCK: tl.constexpr):
    """``OUT[p] = sum of X[p * BLOCK::P * BLOCK]`` blocks, P the programs: a loop whose start
    is a program id, as the cast kernel's grid-stride loop and the attention's KV slices."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(OUT + pid, tl.sum(acc, 0))


def test_a_loop_bounded_by_program_ids_runs_under_the_interpreter():
    triton_interpreter.install()
    x = torch.arange(100, dtype=torch.float32)
    out = torch.zeros(3)
    _strided_sum_kernel[(3,)](x, out, x.numel(), BLOCK=8)
    want = torch.stack([x[(torch.arange(100) // 8) % 3 == p].sum() for p in range(3)])
    assert torch.equal(out, want)
