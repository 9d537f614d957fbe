"""tknp_megatron/tools/bench_step.py's CPU dry run (gloo, 2 processes): the GPU benchmark's eager parts
and its graph-vs-eager token check keep working between GPU sessions."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_step_dry_run(tmp_path):
    out = tmp_path / "bench_step.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "tknp_megatron.tools.bench_step", "--dry-run", "--model", "tiny", "--layers", "4",
           "--batches", "4", "8", "--contexts", "32", "--reps", "1", "--block-size", "4",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["graph_tokens_equal_eager"] is True
    assert [r["B"] for r in report["rows"]] == [4, 8]
    for row in report["rows"]:
        assert row["graph_ms"] > 0 and row["critical_ms"] > 0
        assert set(row["phases_ms_by_rank"][0]) == {
            "root_qkv", "scatter", "attention", "gather", "root_proj_mlp", "handoff"}
