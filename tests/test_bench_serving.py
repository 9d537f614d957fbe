"""tknp_megatron/tools/bench_serving.py on CPU: every mode serves the same traces and agrees on
tokens (the README's smoke command)."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_all_modes_one_invocation(tmp_path):
    """The README's CPU smoke run (its ``--out`` moved here)."""
    from tests.test_readme import commands

    out = tmp_path / "serving"
    (cmd,) = [shlex.split(c) for c, _ in commands() if "bench_serving --world" in c]
    cmd[cmd.index("--out") + 1] = str(out)
    proc = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    modes = {r["mode"] for r in result["rows"]}
    assert modes == {"TKNP", "DP", "TP", "PP", "DCP", "TKNP-MQA"}
    assert result["tokens_agree"] and all(v == 1.0 for v in result["tokens_agree"].values())
    # one engine per mode, built for its first trace and reused for the others
    firsts = {}
    for r in result["rows"]:
        first = firsts.setdefault(r["mode"], r)
        assert (r["engine_build_s"] > 0) == (r is first), (r["mode"], r["context"], r["arrival_rate"])
    assert len(result["rows"]) > len(firsts)
    for r in result["rows"]:
        assert r["completed"] == r["offered_batch"] and r["rejected"] == 0
        assert r["completion_throughput_tok_s"] > 0
        # every rank of every mode records its host work, PP's per microbatch tick too
        assert r["host_ms_p50_per_step"] and all(h > 0 for h in r["host_ms_p50_per_step"]), r["mode"]
        # the attention each row ran: the CPU default, and DCP's shards' own kernels
        dcp = ("torch", "triton decode, torch for prompts")  # the latter under TRITON_INTERPRET=1
        assert r["attention"] in dcp if r["mode"] == "DCP" else r["attention"] == "torch", r
    assert "attention: torch; DCP's shards: " in proc.stdout
    for name in ("results.csv", "throughput_vs_batch.png", "latency_ctx24.png", "slo_vs_rate.png"):
        assert (out / name).stat().st_size > 100
    # a run cut short keeps its finished rows; --report-only rebuilds the report from them
    partial = (out / "partial.jsonl").read_text().splitlines()
    assert len(partial) == len(result["rows"])
    (out / "results.json").unlink()
    redo = subprocess.run([sys.executable, "-m", "tknp_megatron.tools.bench_serving", "--report-only",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]


def test_pending_tokens_skip_the_cached_prompt():
    """A decode step feeds only uncached tokens, without rebuilding prompt + generated."""
    from tknp_megatron.engine.request import Request, RequestTimeline
    from tknp_megatron.sampling import SamplingParams

    req = Request(0, list(range(32768)), SamplingParams(max_new_tokens=8), RequestTimeline(0.0))
    req.generated = [5, 6, 7]
    req.num_cached = 32768 + 2
    pending = req.pending_tokens()
    assert pending == [7]
    req.num_cached = 32760  # mid-prefill: the rest of the prompt, then the generated tokens
    assert req.pending_tokens() == list(range(32760, 32768)) + [5, 6, 7]


def test_traces_over_the_models_length_are_refused_in_one_line(capsys):
    """A context the model cannot hold is refused before any process starts, not served
    as a run in which every request is rejected."""
    import pytest

    from tknp_megatron.tools.bench_serving import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "tiny", "--contexts", "2048", "900", "--batches", "4", "--output-len", "100"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--contexts 2048 with --output-len 100: requests of 2148 tokens, over tiny's " \
           "max_sequence_length 1024" in err and "900" not in err
    with pytest.raises(SystemExit):
        parse_args(["--model", "no-such-model", "--contexts", "64", "--batches", "2"])
    assert "unknown model preset 'no-such-model'" in capsys.readouterr().err
    # a limit below the model's (EngineConfig.max_sequence_length) is the one traces are held to
    base = ["--model", "tiny", "--batches", "4", "--output-len", "100"]
    assert parse_args(base + ["--contexts", "400", "--max-sequence-length", "500"]).max_sequence_length == 500
    for extra, message in ((["--contexts", "401", "--max-sequence-length", "500"],
                            "--contexts 401 with --output-len 100: requests of 501 tokens, over "
                            "--max-sequence-length 500"),
                           (["--contexts", "64", "--max-sequence-length", "2048"],
                            "--max-sequence-length 2048: must be in [1, 1024] (tiny's max_sequence_length)")):
        with pytest.raises(SystemExit):
            parse_args(base + extra)
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_memory_regime_given_as_dps_kv_over_weights(capsys):
    """``--kv-weight-ratio R`` caps each GPU at one copy (over --tp GPUs) plus R times it, says
    so before any process starts, and reports the ratio DP actually kept; bad uses are one line."""
    import pytest

    from tknp_megatron.analysis.costmodel import PAPER_KV_RATIO, gpu_gib_for_kv_ratio
    from tknp_megatron.config import get_preset
    from tknp_megatron.placement import model_bytes
    from tknp_megatron.tools.bench_serving import parse_args, realized_kv_ratio

    base = ["--model", "llama3.1-70b", "--layers", "12", "--contexts", "32768", "--batches", "16"]
    preset = get_preset("llama3.1-70b").replace(num_layers=12)
    copy = model_bytes(preset).total
    args = parse_args(base + ["--device", "cuda", "--kv-weight-ratio", str(PAPER_KV_RATIO)])
    assert args.gpu_memory_gib == pytest.approx(copy * (1 + PAPER_KV_RATIO) / 2**30)
    assert 28 < args.gpu_memory_gib < 29  # the 12-layer slice in the paper's regime
    assert f"each GPU capped at {args.gpu_memory_gib:.2f} GiB" in capsys.readouterr().out
    two = parse_args(base + ["--device", "cuda", "--tp", "2", "--kv-weight-ratio", "0.5"])
    assert two.gpu_memory_gib == pytest.approx(gpu_gib_for_kv_ratio(model_bytes(preset), 0.5, 2))
    assert two.gpu_memory_gib == pytest.approx(copy * 1.5 / 2 / 2**30)

    per_token = 2 * 2 * 12 * preset.num_query_groups * preset.kv_channels
    tokens = int(0.2 * copy / per_token)
    rows = [dict(mode="TKNP", kv_capacity_tokens=[[9, 9]]),
            dict(mode="DP", kv_capacity_tokens=[[tokens], [tokens + 100]])]
    line = realized_kv_ratio(args, rows)
    assert f"DP kept 0.200 of its weights' bytes for KV ({tokens} tokens per replica)" in line

    for extra, says in ((["--device", "cuda", "--kv-weight-ratio", "0"], "--kv-weight-ratio 0.0: must be > 0"),
                        (["--device", "cuda", "--kv-weight-ratio", "0.2", "--gpu-memory-gib", "30"],
                         "not with --gpu-memory-gib"),
                        (["--kv-weight-ratio", "0.2"], "--device cpu: give --kv-tokens-per-node")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(base + extra)
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(ValueError, match="must be > 0"):
        gpu_gib_for_kv_ratio(model_bytes(preset), -1.0)


def test_an_attention_backend_not_usable_here_is_refused_in_one_line(capsys):
    import pytest

    from tknp_megatron.tools.bench_serving import parse_args

    base = ["--model", "tiny", "--contexts", "24", "--batches", "2", "--kv-tokens-per-node", "64"]
    assert parse_args(base + ["--attention-backend", "sdpa"]).attention_backend == "sdpa"
    with pytest.raises(SystemExit) as exit_:
        parse_args(base + ["--attention-backend", "fa3"])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--attention-backend fa3: not usable on cpu; choose one of " in line and "torch" in line


def test_request_slots_per_node_reach_every_modes_engine(capsys):
    """``--max-requests-per-node`` is the engines' slot count (and the graphs' largest bucket);
    below 1 it is refused in one line before any process starts."""
    import pytest

    from tknp_megatron.tools.bench_serving import engine_config, parse_args

    base = ["--model", "tiny", "--contexts", "24", "--batches", "2", "--kv-tokens-per-node", "64"]
    assert engine_config(parse_args(base)).max_requests_per_node == 2  # the most a trace has: never binds
    many = ["--contexts", "24", "--batches", "300", "5", "--mixed-requests", "7", "--mixed-scale", "0.0001"]
    assert engine_config(parse_args(base[:2] + many + ["--kv-tokens-per-node", "64"])).max_requests_per_node == 256
    mixed = ["--contexts", "24", "--batches", "3", "--mixed-requests", "7", "--mixed-scale", "0.0001", "--rates", "50"]
    assert engine_config(parse_args(base[:2] + mixed + ["--kv-tokens-per-node", "64"])).max_requests_per_node == 7
    assert engine_config(parse_args(base + ["--max-requests-per-node", "3"])).max_requests_per_node == 3
    with pytest.raises(SystemExit) as exit_:
        parse_args(base + ["--max-requests-per-node", "0"])
    assert exit_.value.code == 2
    assert "--max-requests-per-node 0: must be >= 1" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_roofline_of_a_row_counts_fp8_weights_at_one_byte():
    """Rows of an FP8 run are held against the roofline of FP8-stored weights, on the
    hardware of the GPU the run had (an H100's HBM is slower than the H200's)."""
    import types

    from tknp_megatron.analysis.roofline import H100, predicted_step_s
    from tknp_megatron.analysis.workload import fixed_length
    from tknp_megatron.config import PRESETS
    from tknp_megatron.tools.bench_serving import _roofline

    preset, trace = PRESETS["llama3.1-70b"], fixed_length(16, 8192, 256)
    context = 8192 + 256 / 2
    h200 = "NVIDIA H200"
    for recipe, elem in ((None, 2.0), ("tensorwise", 1.0)):
        args = types.SimpleNamespace(device="cuda", tp=1, fp8_recipe=recipe)
        predict = _roofline("dp", preset, trace, 1, args, gpu=h200)
        assert predict(16) == predicted_step_s("dp", preset, 1, 1, 16, context, weight_elem=elem)
        on_h100 = _roofline("dp", preset, trace, 1, args, gpu="NVIDIA H100 80GB HBM3")(16)
        assert on_h100 == predicted_step_s("dp", preset, 1, 1, 16, context, hw=H100, weight_elem=elem)
        assert on_h100 > 1.3 * predict(16)
    bf16 = _roofline("dp", preset, trace, 1, types.SimpleNamespace(device="cuda", tp=1, fp8_recipe=None), h200)(16)
    fp8 = _roofline("dp", preset, trace, 1, types.SimpleNamespace(device="cuda", tp=1, fp8_recipe="tensorwise"),
                    h200)(16)
    assert fp8 < 0.75 * bf16  # B = 16 at 8K: the weights' read is most of the step
    assert _roofline("dp", preset, trace, 1, types.SimpleNamespace(device="cpu", tp=1, fp8_recipe=None)) is None


class CutShort(Exception):
    """A time limit right after a mode's first trace."""


def cut_short_worker(rank: int, world: int) -> dict:
    """``run_mode`` over two traces whose caller stops after the first one's run is handed
    over: which runs it saw."""
    import torch

    from tknp_megatron.analysis.serving import run_mode
    from tknp_megatron.analysis.workload import fixed_length
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.mode import Mode

    seen = []

    def on_run(i, run):
        seen.append((i, run.workload, run.metrics.completed))
        raise CutShort

    try:
        run_mode(Mode.DP, get_preset("tiny"), [fixed_length(2, 8, 3), fixed_length(3, 8, 3)],
                 EngineConfig(kv_tokens_per_node=256), 1, torch.float32, torch.device("cpu"), on_run=on_run)
    except CutShort:
        return dict(seen=seen, cut=True)
    return dict(seen=seen, cut=False)


def test_each_trace_is_handed_over_before_the_next_runs():
    """``run_mode`` hands each trace's run to its caller (bench_serving saves the row to
    partial.jsonl) as soon as it ran, so a mode serving many traces on one engine keeps the
    finished ones when a time limit stops it."""
    from tknp_megatron.launch import spawn

    out = spawn(cut_short_worker, 1, (), timeout_s=180)[0]
    assert out == dict(seen=[(0, "fixed-b2-isl8-osl3", 2)], cut=True)
