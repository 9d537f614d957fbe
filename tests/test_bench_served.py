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
