"""The pool simulator: the engine's scheduler on a virtual clock, steps timed by the roofline.

(a) Waves follow from capacity exactly as in the engine: B requests over a pool holding k
    at a time take ceil(B / k) waves, for TKNP's owners and for DP's replicas.
(b) A lone request's inter-token latency is the roofline's step time for its layout.
(c) The README's commands run; the replay of a checked-in H200 run predicts its TKNP, DP
    and TP rows within 10%.
(d) Bad flags: one line, status 2, nothing simulated.
"""

from __future__ import annotations

import json
import math
import shlex

import pytest

from tests.test_readme import commands
from tknp_megatron.analysis import workload as wl
from tknp_megatron.analysis.roofline import predicted_step_s
from tknp_megatron.analysis.simulator import Calibration, simulate
from tknp_megatron.config import get_preset
from tknp_megatron.tools import simulate_pool

PRESET = get_preset("llama3.1-70b").replace(num_layers=12)


@pytest.mark.parametrize("mode, world, per_pool", [("tknp", 2, 4), ("dp", 2, 4), ("tp", 2, 2)])
def test_waves_follow_capacity(mode, world, per_pool):
    """Each owning node holds two 1024 + 32 token requests (66 blocks of 16 <= 140): TKNP
    (2 owners) and DP (2 replicas of 1) hold 4 at a time, TP (one owner) 2."""
    trace = wl.fixed_length(12, 1024, 32, seed=0)
    run = simulate(mode, PRESET, world, 1, trace, kv_tokens_per_node=140 * 16)
    assert run.metrics.completed == 12
    assert run.metrics.waves == math.ceil(12 / per_pool)
    assert run.metrics.output_tokens == 12 * 32


def test_a_lone_request_steps_at_the_roofline():
    trace = wl.fixed_length(1, 4096, 16, seed=0)
    run = simulate("tknp", PRESET, 2, 1, trace, kv_tokens_per_node=1 << 16, calibration=Calibration())
    # the owner holds the whole context (4096 + the tokens so far); the roofline's TKNP
    # step spreads a batch over both nodes, so the busiest owner's share is the context x 2
    lo = predicted_step_s("tknp", PRESET, 2, 1, 1, 2 * 4096)
    hi = predicted_step_s("tknp", PRESET, 2, 1, 1, 2 * (4096 + 16))
    assert lo <= run.metrics.itl_s_p50 <= hi * 1.0001


def _readme(flag: str) -> list:
    """The README's simulate_pool command with ``flag``, as the tool's argv."""
    (cmd,) = [c for c, _ in commands() if "simulate_pool" in c and flag in c]
    return shlex.split(cmd)[3:]  # python -m tknp_megatron.tools.simulate_pool


def test_readme_commands_and_the_replay_of_an_h200_run(tmp_path, capsys):
    assert simulate_pool.main(_readme("--kv-tokens-per-node") + ["--json", str(tmp_path / "a.json")]) == 0
    rows = json.loads((tmp_path / "a.json").read_text())
    assert [r["mode"] for r in rows] == ["TKNP", "DP", "TP"] * 2
    assert simulate_pool.main(_readme("--replay") + ["--json", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())
    assert len(rows) == 6
    for r in rows:
        assert r["waves"] == r["measured_waves"], r
        assert abs(r["predicted_over_measured"] - 1) < 0.10, r
    assert "pred/meas" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--world", "3", "--tp", "2", "--kv-tokens-per-node", "4096"], "--tp 2: must divide --world 3"),
    (["--world", "2"], "--kv-tokens-per-node: required (or --gpu-memory-gib, --kv-weight-ratio, or --replay"),
    (["--kv-tokens-per-node", "8"], "--kv-tokens-per-node 8: must hold at least one block of 16"),
    (["--replay", "/nonexistent"], "--replay /nonexistent: no results.json there"),
    (["--kv-tokens-per-node", "4096", "--gpu-memory-gib", "30"], "--kv-tokens-per-node and --gpu-memory-gib: give one"),
    (["--kv-weight-ratio", "0"], "--kv-weight-ratio 0.0: must be > 0"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
    assert simulate_pool.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("simulate_pool.py: error: ") and message in err[0]


def test_capacity_per_owner_from_the_capacity_model():
    """The paper's 405B node (454 GiB of weights, 106 GiB of DP KV) on 4 nodes: a DP replica
    holds 106 GiB, a TKNP node (4 x 560 - 454) / 4 GiB, DCP's one pool all of that."""
    from tknp_megatron.analysis.costmodel import budget_from_measurement
    from tknp_megatron.analysis.simulator import kv_tokens_per_owner

    l405 = get_preset("llama3.1-405b")
    per_token = 2 * 2 * 126 * 8 * 128
    budget = budget_from_measurement(454.0, 106.0, 8, 8)
    assert kv_tokens_per_owner("dp", l405, 4, budget) == int(106 * 2**30 // per_token)
    assert kv_tokens_per_owner("tknp", l405, 4, budget) == int((4 * 560 - 454) / 4 * 2**30 // per_token)
    assert kv_tokens_per_owner("dcp", l405, 4, budget) == int((4 * 560 - 454) * 2**30 // per_token)


def test_paper_headlines_table(tmp_path, capsys):
    from tknp_megatron.analysis.paper_figures import HEADLINES

    assert simulate_pool.main(["--paper", "--paper-batches", "8", "--json", str(tmp_path / "p.json")]) == 0
    out = json.loads((tmp_path / "p.json").read_text())
    rows = out["headlines"]
    assert [(r["what"], r["paper"], r["batch"]) for r in rows] == [(h.what, h.paper, 8) for h in HEADLINES]
    assert len(out["modes"]) == 5 and all(len(r["tok_s"]) == 5 for r in out["modes"])
    assert [(r["nodes"], r["batch"]) for r in out["dual"]] == [(n, 8) for n in (2, 2, 4, 4, 8, 8)]
    assert all(0 < r["predicted"] < 10 for r in rows)
    out = capsys.readouterr().out
    assert all(h.what in out for h in HEADLINES)


def test_dual_roots_run_two_microbatches_and_lose_capacity():
    """tknp-dual: the engine's two microbatches (requests split by owner load) on a dual
    placement's capacity; every request completes, and with half the KV per node the same
    trace needs more waves than the single copy."""
    trace = wl.fixed_length(16, 1024, 16, seed=0)
    single = simulate("tknp", PRESET, 4, 1, trace, kv_tokens_per_node=140 * 16)
    dual = simulate("tknp-dual", PRESET, 4, 1, trace, kv_tokens_per_node=70 * 16,
                    schedule="tknp-dual-paper")
    assert single.metrics.completed == dual.metrics.completed == 16
    assert (single.metrics.waves, dual.metrics.waves) == (2, 4)


def test_fp8_weights_shorten_weight_bound_steps(tmp_path):
    """``--fp8-weights``: one byte per linear weight, so a small batch's predicted step (weight
    reads dominate) is shorter than with BF16 weights, and throughput higher."""
    argv = ["--model", "llama3.1-70b", "--layers", "12", "--world", "2", "--modes", "dp", "--contexts", "4096",
            "--batches", "4", "--output-len", "16", "--kv-tokens-per-node", "65536"]
    out = {}
    for name, extra in (("bf16", []), ("fp8", ["--fp8-weights"])):
        assert simulate_pool.main(argv + extra + ["--json", str(tmp_path / f"{name}.json")]) == 0
        (out[name],) = json.loads((tmp_path / f"{name}.json").read_text())
    assert out["fp8"]["itl_s_p50"] < 0.8 * out["bf16"]["itl_s_p50"]
    assert out["fp8"]["completion_throughput_tok_s"] > out["bf16"]["completion_throughput_tok_s"]


def test_each_modes_kv_from_the_memory_regime(tmp_path, capsys):
    """``--kv-weight-ratio`` / ``--gpu-memory-gib``: each mode's KV tokens from the capacity
    model (DP keeps the ratio of its copy; TKNP each node's share of one copy less), and the
    predicted ratios per trace, TKNP-MQA against DCP on DCP's variant."""
    from tknp_megatron.analysis.costmodel import gpu_gib_for_kv_ratio
    from tknp_megatron.placement import model_bytes

    argv = ["--model", "llama3.1-70b", "--layers", "12", "--world", "2", "--modes", "tknp", "dp", "dcp",
            "--dcp-kv-heads", "1", "--contexts", "8192", "--batches", "8", "--output-len", "8"]
    assert simulate_pool.main(argv + ["--kv-weight-ratio", "0.2335", "--json", str(tmp_path / "r.json")]) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    preset = get_preset("llama3.1-70b").replace(num_layers=12)
    copy = model_bytes(preset).total
    per_token = 2 * 2 * 12 * 8 * 128
    assert rows["DP"]["kv_tokens_per_node"] == int(0.2335 * copy // per_token)
    gib = gpu_gib_for_kv_ratio(model_bytes(preset), 0.2335)
    # a TKNP node holds about half a copy: 1.2335 - 0.5 of a copy for KV, over 3x DP's 0.2335
    assert 3 * rows["DP"]["kv_tokens_per_node"] < rows["TKNP"]["kv_tokens_per_node"] < 3.3 * rows["DP"]["kv_tokens_per_node"]
    out = capsys.readouterr().out
    assert "predicted at ctx 8192, batch 8, rate None: TKNP/DP " in out and "TKNP-MQA/DCP " in out
    assert simulate_pool.main(argv + ["--gpu-memory-gib", str(gib), "--json", str(tmp_path / "g.json")]) == 0
    same = {r["mode"]: r["kv_tokens_per_node"] for r in json.loads((tmp_path / "g.json").read_text())}
    assert same == {m: r["kv_tokens_per_node"] for m, r in rows.items()}
