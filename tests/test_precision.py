"""The dense-layer format (:mod:`tknp_megatron.models.precision`) off GPU: what is refused
and why, what ``auto`` becomes, how FP8 weights change the byte-balanced placement, and
that the bytes an engine reports are the bytes its parameters hold. The Transformer Engine
and FP8 paths themselves run on the GPU machine (benchmarks/scripts/h200_te_fp8.sh)."""

from __future__ import annotations

import pytest
import torch

from tknp_megatron.config import PRESETS
from tknp_megatron.engine.factory import dense_format_for, placement_for
from tknp_megatron.mode import Mode
from tknp_megatron.models.precision import DenseFormat, stored_bytes

CPU = torch.device("cpu")


def test_auto_is_local_off_gpu_and_local_stays_local():
    assert DenseFormat().resolved(CPU).transformer_impl == "local"
    assert DenseFormat("local").resolved(CPU).describe() == "local layers"


@pytest.mark.parametrize("fmt, line", [
    (DenseFormat(fp8_recipe="tensorwise"), "--fp8-recipe: Transformer Engine runs on GPUs only (--device cpu)"),
    (DenseFormat("local", "tensorwise"), "FP8 layers are Transformer Engine's; not with --transformer-impl local"),
    (DenseFormat(fp8_recipe="delayed"), "--fp8-recipe delayed: not served"),
    (DenseFormat(fp8_recipe="tensorwise", fp8_format="e5m2"), "--fp8-format e5m2: choose one of hybrid, e4m3"),
    (DenseFormat("te"), "--transformer-impl te: choose one of auto, local, transformer_engine"),
])
def test_refusals_name_the_flag(fmt, line):
    with pytest.raises(ValueError, match=None) as err:
        fmt.resolved(CPU)
    assert line in str(err.value)
    assert "\n" not in str(err.value)


def test_without_transformer_engine_a_gpu_run_says_so(monkeypatch):
    """A GPU machine without TE (here: whether or not this one has it, the lookup says no)."""
    import tknp_megatron.models.precision as precision

    monkeypatch.setattr(precision, "te_installed", lambda: False)
    problems = DenseFormat(fp8_recipe="tensorwise").problems("cuda")
    assert problems == ["--fp8-recipe: Transformer Engine is not installed "
                        "(pip install transformer-engine[pytorch])"]


def test_dcp_takes_every_format_as_the_other_modes_do():
    """DCP's QKV has local and TE layers: off GPU it resolves to local layers and refuses
    FP8 with the same line as every mode (TE runs on GPUs only)."""
    assert dense_format_for(Mode.DCP, DenseFormat(), CPU).transformer_impl == "local"
    for mode in (Mode.DCP, Mode.TKNP):
        with pytest.raises(ValueError, match=r"--fp8-recipe: Transformer Engine runs on GPUs only"):
            dense_format_for(mode, DenseFormat(fp8_recipe="tensorwise"), CPU)


class _Groups:
    def __init__(self, nodes):
        self.num_nodes = nodes


def test_fp8_weights_rebalance_the_placement():
    """FP8 GEMM weights count one byte an element, the embedding and output layer two: on
    Llama-3.1-70B over 8 nodes each node stores about half, and the end nodes (which hold
    the BF16 vocabulary matrices) get fewer layers than with BF16 weights (8 not 9)."""
    preset = PRESETS["llama3.1-70b"]
    fp8 = DenseFormat("transformer_engine", "tensorwise")
    bf16 = placement_for(Mode.TKNP, preset, _Groups(8))
    eight = placement_for(Mode.TKNP, preset, _Groups(8), fp8)
    assert 0.5 < max(eight.node_bytes) / max(bf16.node_bytes) < 0.56
    assert (bf16.blocks[0], eight.blocks[0]) == ((0, 9), (0, 8))


def test_stored_bytes_counts_what_parameters_hold():
    layer = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    assert stored_bytes(layer) == (64 * 32 + 32) * 2


def test_check_fp8_script_runs_on_cpu(tmp_path):
    """The GPU check's own code path off GPU (local layers only): TKNP's first tokens and
    logits against Megatron's GPTModel in fp32, as the GPU run compares each format, every
    mode's tokens against TKNP's, and DCP's (one-KV-head variant) against both."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tknp_megatron.tools.check_fp8", "--device", "cpu", "--model", "tiny",
         "--layers", "2", "--requests", "4", "--prompt-len", "8", "--output-len", "3",
         "--parts", "tokens", "modes", "dcp", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["tokens"]
    assert row["format"] == "local" and row["megatron_first_token_agreement"] == 1.0
    assert row["megatron_first_logit_max_diff"] < 1e-4
    modes = {r["mode"]: r["vs_tknp_eager"]["token_agreement"] for r in report["modes"]}
    assert modes == {"tknp": 1.0, "dp": 1.0, "tp": 1.0, "pp": 1.0}
    (dcp,) = report["dcp"]
    assert dcp["megatron_first_token_agreement"] == 1.0 and dcp["megatron_first_logit_max_diff"] < 1e-4
    assert dcp["vs_tknp"]["token_agreement"] == 1.0


def test_rows_are_padded_by_the_step_only_where_the_zero_rows_stay_zero():
    """row_alignment: 1 (Megatron's per-GEMM padding, or none) without FP8, and with FP8
    for a LayerNorm or biased model, whose padded rows would not stay zero through a layer
    and would enter FC2's per-tensor amax. (The FP8 Llama case, 16, needs TE: the GPU
    machine's bench_step compares its tokens with Megatron's padding, check_row_padding; the
    padding itself runs on CPU in the llama-graph-aligned scenario of the end-to-end tests.)"""
    from types import SimpleNamespace

    from tknp_megatron.models.precision import row_alignment

    assert row_alignment(SimpleNamespace(fp8=None, normalization="RMSNorm", add_bias_linear=False)) == 1
    assert row_alignment(SimpleNamespace(fp8="hybrid", normalization="LayerNorm", add_bias_linear=False)) == 1
    assert row_alignment(SimpleNamespace(fp8="hybrid", normalization="RMSNorm", add_bias_linear=True)) == 1
