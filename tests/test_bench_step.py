"""tknp_megatron/tools/bench_step.py's CPU dry run (gloo, 2 processes): the GPU benchmark's eager parts
and its graph-vs-eager token check keep working between GPU sessions."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tp", [1, 2])  # two nodes (TKNP), one node of TP2 (TP)
def test_bench_step_dry_run(tmp_path, tp):
    out = tmp_path / "bench_step.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "tknp_megatron.tools.bench_step", "--dry-run", "--model", "tiny", "--layers", "4",
           "--batches", "4", "8", "--contexts", "32", "--reps", "1", "--block-size", "4",
           "--tp", str(tp), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["nodes"], report["tp"]) == (2 // tp, tp)
    assert report["graph_tokens_equal_eager"] is True
    assert [r["B"] for r in report["rows"]] == [4, 8]
    for row in report["rows"]:
        assert row["graph_ms"] > 0 and row["critical_ms"] > 0
        assert set(row["phases_ms_by_rank"][0]) == {
            "root_qkv", "scatter", "attention", "gather", "root_proj_mlp", "handoff"}


def test_kernels_are_told_apart_and_the_gap_is_named_part_by_part():
    from tknp_megatron.analysis.roofline import StepParts
    from tknp_megatron.tools.bench_step import kernel_kind, roofline_gap

    names = {  # names as CUPTI reports them on an H200
        "_paged_attn_kernel": "attention", "_combine_splits_kernel": "attention",
        "void flash::prepare_varlen_num_blocks_kernel<1, 16, true>(int, int, int, int const*)": "attention",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...> > >": "attention",
        "nvjet_tst_128x64_64x8_2x1_v_bz_coopA_NNT": "gemm", "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm",
        "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "gemm",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "nccl",
        "_rms_norm_kernel": "other", "_rope_append_kernel": "other",
    }
    assert {n: kernel_kind(n) for n in names} == names
    row = dict(graph_ms=10.0, busy_ms=9.5, kind_ms=dict(attention=6.0, gemm=3.0, nccl=0.0, other=0.5))
    gap = roofline_gap(row, StepParts(gemm=2.5e-3, allreduce=0.0, attention=5.5e-3, exchange=0.0, logits=0.25e-3))
    assert gap["step"] == dict(measured_ms=10.0, roofline_ms=pytest.approx(8.25))
    assert gap["gemm"]["roofline_ms"] == pytest.approx(2.75) and gap["idle"]["measured_ms"] == pytest.approx(0.5)
    excess = sum(v["measured_ms"] - v["roofline_ms"] for k, v in gap.items() if k != "step")
    assert excess == pytest.approx(10.0 - 8.25)  # the parts account for the whole gap
    # with the replay timed alone, the idle time splits into the host's part and the gaps
    gap = roofline_gap(dict(row, replay_ms=9.7), StepParts(2.5e-3, 0.0, 5.5e-3, 0.0, 0.25e-3))
    assert gap["host"]["measured_ms"] == pytest.approx(0.3) and gap["idle"]["measured_ms"] == pytest.approx(0.2)
    assert sum(v["measured_ms"] for k, v in gap.items() if k != "step") == pytest.approx(10.0)


def test_fp8_without_a_gpu_is_refused_in_one_line(capsys):
    from tknp_megatron.tools.bench_step import dense_format, main, parse_args

    with pytest.raises(SystemExit) as exc:  # the tool's entry point: refused before any process
        main(["--dry-run", "--fp8-recipe", "tensorwise"])
    assert exc.value.code == 2
    assert "--fp8-recipe tensorwise: Transformer Engine's layers run on GPUs only" \
        in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit):
        parse_args(["--dry-run", "--transformer-impl", "transformer_engine"])
    # --fp8-recipe alone means TE layers; the default stays Megatron's local layers
    assert dense_format(parse_args(["--dry-run"])).transformer_impl == "local"
    fp8 = dense_format(argparse.Namespace(fp8_recipe="tensorwise", transformer_impl="local"))
    assert (fp8.transformer_impl, fp8.fp8_recipe) == ("auto", "tensorwise")
