"""The main job with bad input: one line naming the flag or file, the value and what is
allowed, exit status 2, no traceback, and no process started. Also: requests the engine
refuses are reported as refused (the reference serves only the others), and the JSON
report is strict JSON even when a metric has nothing to measure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_job_module, run_main_job

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "run_tknp_decode.py"


SMALL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "vocab_size": 64, "max_sequence_length": 64, "normalization": "RMSNorm"}
# model configs with a value of the wrong type, sign or shape: each refused by name
BAD_CONFIGS = {
    "strlayers": {"num_layers": "2"}, "floatlayers": {"num_layers": 2.0}, "noheads": {"num_attention_heads": 0},
    "negffn": {"ffn_hidden_size": -128}, "strbool": {"add_bias_linear": "false"},
    "oddhead": {"kv_channels": 15}, "fracbase": {"rotary_base": 20.9},
    "clamp": {"activation_func_clamp_value": 0.001},
}


def _files(tmp: Path) -> dict:
    """Named bad files for the table."""
    out = {}
    for name, text in {
        "empty": "", "notjson": "{oops", "emptylist": "[]", "emptyprompt": "[[]]",
        "floats": "[[1.5, 2]]", "negative": "[[-5, 3]]", "oov": "[[1, 600]]",
        "badconfig": json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                 "vocab_size": 64, "max_sequence_length": 64,
                                 "hiden_size": 3, "vocab_sise": 4}),
        "moe": json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                           "vocab_size": 64, "max_sequence_length": 64, "num_moe_experts": 8}),
        **{name: json.dumps({**SMALL, **change}) for name, change in BAD_CONFIGS.items()},
    }.items():
        path = tmp / f"{name}.json"
        path.write_text(text)
        out[name] = str(path)
    (tmp / "nothf").mkdir()
    out["nothf"] = str(tmp / "nothf")
    out["missing"] = str(tmp / "missing.json")
    out["nodir"] = str(tmp / "nodir" / "out.json")
    return out


# (flags, what stderr's one line must contain); {name} is a file of _files
BAD = [
    (["--nodes", "0"], "--nodes 0: must be at least 1"),
    (["--tp", "0"], "--tp 0: must be at least 1"),
    (["--requests", "0"], "--requests 0: must be at least 1"),
    (["--block-size", "0"], "--block-size 0: must be at least 1"),
    (["--output-len", "0"], "--output-len 0: must be at least 1"),
    (["--kv-tokens-per-node", "0"], "--kv-tokens-per-node 0: must be at least 1"),
    (["--prompt-len", "10", "5"], "--prompt-len 10 5: needs 1 <= MIN <= MAX"),
    (["--timeout", "0"], "--timeout 0.0: must be positive"),
    (["--nodes", "8"], "--nodes 8: at most 6, the layers of tiny"),
    (["--tp", "3"], "--tp 3: must divide the 4 attention heads of tiny"),
    (["--model", "tiny-llama"], "--model tiny-llama: unknown preset; known:"),
    (["--attention-backend", "flashy"], "--attention-backend flashy: not usable on cpu"),
    (["--prompts-file", "{empty}"], "empty.json: not JSON"),
    (["--prompts-file", "{notjson}"], "notjson.json: not JSON"),
    (["--prompts-file", "{emptylist}"], "emptylist.json: expected a non-empty JSON list"),
    (["--prompts-file", "{emptyprompt}"], "emptyprompt.json: prompt 0 is empty"),
    (["--prompts-file", "{floats}"], "floats.json: prompt 0 is [1.5, 2]; expected token-id list"),
    (["--prompts-file", "{negative}"], "prompt 0 has token id -5, outside the vocabulary [0, 512)"),
    (["--prompts-file", "{oov}"], "prompt 0 has token id 600, outside the vocabulary [0, 512)"),
    (["--prompts-file", "{missing}"], "missing.json: no such file"),
    (["--model-config", "{missing}"], "--model-config {missing}: no such file"),
    (["--timeout", "inf"], "--timeout inf: must be positive (seconds) and at most 1000000000"),
    (["--seed", str(2**64)], f"--seed {2**64}: must fit in 64 bits (signed)"),
    (["--json", "{nodir}"], "--json {nodir}: its directory"),
    (["--json", "{nothf}"], "--json {nothf}: a directory, not a file"),
    (["--kv-tokens-per-node", "1"], "--kv-tokens-per-node 1: must hold at least one block (--block-size 16)"),
    (["--kv-tokens-per-node", str(10**12)], f"--kv-tokens-per-node {10**12}: "),
    (["--prompt", "hello"], "--prompt needs --tokenizer"),
    (["--model", "tiny", "--load", "{nothf}"], "--model is a preset with seeded weights: not with --load"),
    (["--model-config", "{badconfig}"], "['hiden_size', 'vocab_sise']"),
    (["--model-config", "{moe}"], "mixture of experts (num_moe_experts=8)"),
    (["--model-config", "{strlayers}"], "num_layers '2': must be a positive integer"),
    (["--model-config", "{floatlayers}"], "num_layers 2.0: must be a positive integer"),
    (["--model-config", "{noheads}"], "num_attention_heads 0: must be a positive integer"),
    (["--model-config", "{negffn}"], "ffn_hidden_size -128: must be a positive integer"),
    (["--model-config", "{strbool}"], "add_bias_linear 'false': must be true or false"),
    (["--model-config", "{oddhead}"], "RoPE rotates 15 of the 15 channels of a head"),
    (["--model-config", "{fracbase}"], "rotary_base 20.9: must be a whole number"),
    (["--model-config", "{clamp}"], "an activation clamp (activation_func_clamp_value=0.001)"),
    (["--hf", "{nothf}"], "not a Hugging Face model folder (no config.json)"),
    (["--load", "{missing}"], "no such directory"),
    (["--tokenizer", "{nothf}"], "not a tokenizer folder"),
    (["--device", "cuda"], "--device cuda: runs under torchrun"),
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe: Transformer Engine runs on GPUs only (--device cpu)"),
    (["--fp8-recipe", "delayed"], "--fp8-recipe delayed: not served (its scales come from an amax "
                                  "history that only training steps update"),
    (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8: not served (MXFP8 runs on Blackwell GPUs only)"),
    (["--fp8-recipe", "fp4"], "--fp8-recipe fp4: choose one of tensorwise, blockwise"),
    (["--fp8-format", "e5m2"], "--fp8-format e5m2: choose one of hybrid, e4m3"),
    (["--transformer-impl", "te"], "--transformer-impl te: choose one of auto, local, transformer_engine"),
    (["--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine: Transformer Engine runs on GPUs only (--device cpu)"),
]


@pytest.fixture(scope="module")
def job():
    return load_job_module()


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input_is_one_line_and_status_2(job, tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr(job, "spawn", _no_pool)  # nothing may start
    files = _files(tmp_path)
    status = job.main([f.format(**files) for f in flags])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_tknp_decode.py: error: "), err
    assert message.format(**files) in lines[0]


def test_a_tp_group_spanning_hosts_is_refused(job, capsys, monkeypatch):
    """Under torchrun a node's TP group must sit inside one host (its all-reduces stay
    on NVLink): two hosts of one process each cannot run --tp 2."""
    monkeypatch.setattr(job, "spawn", _no_pool)
    for name, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    assert job.main(["--nodes", "2", "--tp", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "run_tknp_decode.py: error: --tp 2: a node's TP group stays on one host, so it must "
        "divide torchrun's --nproc-per-node 1")


def _no_pool(*args, **kwargs):
    raise AssertionError("a pool was started for bad input")


def test_bad_input_exit_status_from_the_shell(tmp_path):
    """The same as a user sees it: a real process, status 2, one line, no traceback."""
    proc = subprocess.run([sys.executable, str(JOB), "--tp", "3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "run_tknp_decode.py: error: --tp 3: must divide the 4 attention heads of tiny; "
        "--tp 3: must divide the 2 KV heads of tiny; --tp 3: must divide the 160 MLP width of tiny"]


def test_refused_requests_and_strict_json(tmp_path):
    """Prompts too long for the model are refused with a reason, the others are served
    and checked against the reference (which serves only them); one-token outputs leave
    inter-token latency unmeasured, which the JSON says with null, not NaN."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7], [1] * 1024, [9, 8]]))
    out = tmp_path / "out.json"
    status, stdout, stderr = run_main_job("--prompts-file", prompts, "--output-len", 1, "--nodes", 2,
                                          "--tp", 1, "--json", out, "--quiet")
    assert status == 0, stderr[-3000:]
    report = json.loads(out.read_text())  # strict: json would refuse NaN only when asked,
    assert "NaN" not in out.read_text()   # so look for it too
    assert (report["completed"], report["rejected"]) == (2, 1)
    assert "request 1: prompt 1024 + max_new_tokens 1 = 1025 tokens exceeds max_sequence_length 1024" \
        in report["reject_reasons"]["1"]
    assert report["match_reference"] is True and report["itl_p95_s"] is None
    assert "rejected: request 1" in stdout


def test_nothing_compared_is_not_a_match(tmp_path):
    """Every request refused (each needs more KV than a node holds): the report says the
    reference was not compared (null, "n/a"), not that it matched."""
    out = tmp_path / "out.json"
    status, stdout, stderr = run_main_job("--kv-tokens-per-node", 16, "--prompt-len", 30, 40, "--requests", 3,
                                          "--nodes", 2, "--tp", 1, "--json", out, "--quiet")
    assert status == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["completed"], report["rejected"]) == (0, 3)
    assert report["match_reference"] is None and report["token_match_rate"] is None
    assert "match_reference: n/a" in stdout


def _run_with_tty_stderr(*flags) -> str:
    """Run the main job with stderr on a pseudo-terminal; what it wrote there."""
    import os
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(JOB), "--requests", "4", "--output-len", "3", *flags],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the terminal closed: the job exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.wait(timeout=240) == 0, shown[-3000:]
    return shown


def test_progress_lines_on_a_terminal_only(job, monkeypatch):
    shown = _run_with_tty_stderr()
    assert "TKNP: 4/4 requests" in shown and "reference: 4/4 requests" in shown
    # --quiet on a terminal, and any stderr that is not one (piped, a file), show none (what
    # Job.progress, which the ranks read, says; tests/test_multi_host.py pipes a real job's)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert job.prepare_job(job.parse_args([])).progress
    assert not job.prepare_job(job.parse_args(["--quiet"])).progress
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not job.prepare_job(job.parse_args([])).progress


def test_a_flag_argparse_refuses_is_one_line_too(job, capsys, monkeypatch):
    """argparse's own refusals (a value of the wrong type) come without its usage lines."""
    monkeypatch.setattr(job, "spawn", _no_pool)
    with pytest.raises(SystemExit) as exc:
        job.main(["--nodes", "two"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "run_tknp_decode.py: error: argument --nodes: invalid int value: 'two'"]
