"""Bad command-line input: one line on stderr naming the flag, exit status 2, before any work."""

import importlib
import json

import pytest
import torch

CUDA = torch.cuda.is_available()


def _tool(name):
    return importlib.import_module(f"tknp_megatron.tools.{name}")


CASES = [
    ("capacity_report", "parse_args", ["--model", "nope"], "--model nope: unknown model preset 'nope'; known:"),
    ("capacity_report", "parse_args", ["--nodes", "0"], "--nodes 0: must be >= 1"),
    ("capacity_report", "parse_args", ["--gpu-memory-gib", "nan"], "--gpu-memory-gib nan: must be > 0 and finite"),
    ("traffic_report", "parse_args", ["--model", "tiny", "--nodes", "2", "--batch", "4", "--root", "2"],
     "--root 2: must be in [0, --nodes 2)"),
    ("traffic_report", "parse_args", ["--model", "tiny", "--nodes", "2", "--batch", "0"], "--batch 0: must be >= 1"),
    ("simulate_pool", "main", ["--kv-tokens-per-node", "1000", "--rates", "nan", "--mixed-requests", "4"],
     "--rates nan: must be > 0 and finite"),
    ("simulate_pool", "main", ["--kv-tokens-per-node", "1000", "--model", "nope"], "--model: unknown model preset"),
    ("simulate_pool", "main", ["--kv-tokens-per-node", "1000", "--contexts", "0"], "--contexts 0: must be >= 1"),
    ("simulate_pool", "main", ["--kv-tokens-per-node", "1000", "--json", "/no/such/dir/x.json"],
     "--json /no/such/dir/x.json: no directory"),
    ("simulate_pool", "main", ["--replay", "{bad_replay}"], "results.json is not JSON"),
    ("bench_serving", "parse_args", ["--world", "0"], "--world 0: must be >= 1"),
    ("bench_serving", "parse_args", ["--world", "two"], "argument --world: invalid int value: 'two'"),
    ("capacity_report", "parse_args", ["--bogus"], "unrecognized arguments: --bogus"),
    ("convert_hf_checkpoint", "main", ["--out", "{tmp}"], "the following arguments are required: --hf"),
    ("bench_serving", "parse_args", ["--world", "2", "--tp", "3"], "--tp 3: must divide the world of 2"),
    ("bench_serving", "parse_args", ["--out", "{file}"], "is a file, not a directory"),
    ("bench_serving", "parse_args", ["--report-only", "--out", "{tmp}"], "no partial.jsonl there"),
    ("bench_serving", "parse_args", ["--layers", "0", "--out", "{tmp}"], "--layers 0: must be >= 1 and <= 6"),
    ("bench_serving", "parse_args", ["--layers", "7", "--out", "{tmp}"], "--layers 7: must be >= 1 and <= 6"),
    ("bench_served", "parse_args", ["--model", "tiny", "--layers", "0"], "--layers 0: must be >= 1"),
    ("bench_step", "parse_args", ["--dry-run", "--model", "tiny", "--layers", "99"], "--layers 99: must be"),
    ("bench_step", "parse_args", ["--dry-run", "--model", "tiny", "--layers", "2", "--reps", "0"], "--reps 0"),
    ("bench_megatron_engine", "parse_args", ["--model", "llama3.1-8b", "--layers", "0"], "--layers 0: must be"),
    ("check_fp8", "parse_args", ["--device", "cpu", "--model", "nope"], "--model nope: unknown model preset"),
    ("check_fp8", "parse_args", ["--device", "cpu", "--model", "tiny", "--layers", "0"], "--layers 0: must be"),
    ("bench_attention", "parse_args", ["--heads", "8:x"], "--heads '8:x': expected"),
    ("bench_attention", "parse_args", ["--dry-run", "--models", "nope"], "--models nope: unknown model preset"),
    ("bench_attention", "parse_args", ["--dry-run", "--models", "tiny", "--tp", "0"], "--tp 0: must be >= 1"),
    ("bench_host", "main", ["--nodes", "0"], "--nodes 0: must be >= 1"),
    ("token_agreement", "parse_args", ["--load", "{file}", "--expected", "{file}"], "--load {file}: not a directory"),
    ("token_agreement", "parse_args", ["--load", "{tmp}", "--expected", "{uneven}"],
     "--expected {uneven}: 1 prompts but 2 token lists"),
]
if not CUDA:
    CASES += [
        ("bench_step", "main", ["--model", "tiny", "--layers", "2"], "no CUDA device on this machine"),
        ("bench_served", "parse_args", ["--device", "cuda"], "--device cuda: no CUDA device"),
        ("check_fp8", "parse_args", ["--model", "tiny"], "--device cuda: no CUDA device"),
        ("token_agreement", "parse_args", ["--load", "{tmp}", "--expected", "{even}"], "--device cuda: no CUDA"),
    ]


@pytest.mark.parametrize("tool, entry, argv, needle", CASES)
def test_bad_input_is_one_line_and_exit_2(tool, entry, argv, needle, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "results.json").write_text("{not json")
    (tmp_path / "uneven.json").write_text(json.dumps(dict(prompts=[[1]], tokens=[[2], [3]])))
    (tmp_path / "even.json").write_text(json.dumps(dict(prompts=[[1]], tokens=[[2]])))
    subs = dict(tmp=str(tmp_path / "out"), file=str(tmp_path / "a_file"), bad_replay=str(tmp_path / "replay"),
                uneven=str(tmp_path / "uneven.json"), even=str(tmp_path / "even.json"))
    (tmp_path / "out").mkdir()
    argv = [a.format(**subs) for a in argv]
    needle = needle.format(**subs)
    fn = getattr(_tool(tool), entry)
    with pytest.raises(SystemExit) as exc:
        code = fn(argv)
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    assert err.strip().splitlines() == [errors[0]]  # no usage lines around it
    assert needle in errors[0], err


def test_cost_model_refuses_nan():
    from tknp_megatron.analysis.costmodel import NodeBudget

    with pytest.raises(ValueError):
        NodeBudget(float("nan"), 1.0, 8, 8)


def test_run_preset_refuses_layers_out_of_range():
    import argparse

    from tknp_megatron.analysis.bench_traces import run_preset

    with pytest.raises(ValueError, match="--layers 0"):
        run_preset(argparse.Namespace(model="tiny", layers=0))
    assert run_preset(argparse.Namespace(model="tiny", layers=None)).num_layers == 6


def test_check_fp8_fails_when_a_part_fails(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE"):  # the tool's world of one sets them: gone again after the test,
        monkeypatch.setenv(name, "0")     # or later tests' subprocesses would think torchrun started them
        monkeypatch.delenv(name)
    fp8 = _tool("check_fp8")
    monkeypatch.setattr(fp8, "tokens_part", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    assert fp8.main(["--device", "cpu", "--model", "tiny", "--layers", "1", "--parts", "tokens"]) == 1
    assert "failed: tokens" in capsys.readouterr().err


def test_check_fp8_sizes_its_cpu_cache_in_whole_blocks(monkeypatch, capsys, tmp_path):
    """One request of 4 + 3 tokens: less than one KV block of tokens, so the CPU budget is
    each request's tokens rounded up to whole blocks, not their bare sum."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    fp8 = _tool("check_fp8")
    out = tmp_path / "check.json"
    assert fp8.main(["--device", "cpu", "--model", "tiny", "--layers", "1", "--requests", "1",
                     "--prompt-len", "4", "--output-len", "3", "--parts", "modes", "--out", str(out)]) == 0
    modes = {r["mode"]: r["vs_tknp_eager"]["token_agreement"] for r in json.loads(out.read_text())["modes"]}
    assert modes == {"tknp": 1.0, "dp": 1.0, "tp": 1.0, "pp": 1.0}
