"""The served-vs-offline benchmark's CPU form (its GPU form is
benchmarks/scripts/h200_served_0192.sh): both paths serve the trace, the server's tokens
equal the offline engine's (fp32), and the report says both throughputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_served_and_offline_give_the_same_tokens(tmp_path):
    out = tmp_path / "served.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tknp_megatron.tools.bench_served", "--gpus", "2", "--nodes", "2",
         "--tp", "1", "--requests", "8", "--output-len", "4", "--timeout", "240", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["token_agreement"] == 1.0
    assert {r["tokens"] for r in report["rows"].values()} == {8 * 4}
    assert all(r["tok_per_s"] > 0 for r in report["rows"].values())
    # the server's step log accounts for each timed pass: every request arrived and was
    # answered inside it, after the pass's first send
    for timeline, wall in zip(report["served_timelines"], report["rows"]["served"]["walls"]):
        assert timeline["steps"] >= 4 and timeline["admitting_steps"] >= 1
        assert 0 <= timeline["first_arrival_s"] <= timeline["last_arrival_s"] <= timeline["last_reply_s"] <= wall
        assert timeline["full_gc"] >= 0 and timeline["full_gc_s"] >= 0  # the pool's full collections
    assert report["pool"]["steps"] >= 2 * 4 and report["pool"]["completed"] == 8 * 4  # a warm-up and 3 timed passes of 8
    assert report["pool"]["graph_captures"] == 0


def test_offline_only_times_the_engine_with_the_backend_asked_for(tmp_path):
    """``--offline-only`` (the engine alone, e.g. one attention backend against another):
    no server, the offline engine's throughput, with ``--attention-backend`` reaching it (an
    unknown name must fail the run, so the flag is not ignored)."""
    base = [sys.executable, "-m", "tknp_megatron.tools.bench_served", "--gpus", "1", "--nodes", "1", "--tp", "1",
            "--requests", "3", "--prompt-len", "20", "--output-len", "3", "--passes", "1", "--offline-only",
            "--timeout", "120"]
    out = tmp_path / "offline.json"
    proc = subprocess.run(base + ["--attention-backend", "torch", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["offline"]["tokens"] == 3 * 3 and report["offline"]["tok_per_s"] > 0 and "served" not in report
    bad = subprocess.run(base + ["--attention-backend", "no-such-kernel"], cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    # refused by argparse (exit 2) before any process starts
    assert bad.returncode == 2 and "--attention-backend no-such-kernel: not usable on cpu" in bad.stderr
