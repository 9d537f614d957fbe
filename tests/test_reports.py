"""The capacity and traffic CLIs, run as subprocesses from the repository root."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tool, *args, check=True):
    cmd = [sys.executable, "-m", f"tknp_megatron.tools.{tool.removesuffix('.py')}", *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_capacity_report_reproduces_figure_5():
    out = _run("capacity_report.py", "--model", "llama3.1-405b", "--nodes", 1, 2, 3, 4, 8,
               "--tp", 8, "--weights-gib", 454, "--dp-kv-gib", 106, "--json").stdout
    report = json.loads(out)
    nodes = report["nodes"]
    assert set(nodes) == {"1", "2", "3", "4", "8"}
    for n, paper in {"2": 3.3, "4": 4.4, "8": 5.0}.items():
        assert abs(nodes[n]["tknp_over_dp"] / paper - 1) < 0.06
    assert nodes["8"]["dp"] == pytest.approx(848)
    assert nodes["8"]["tknp"] == pytest.approx(8 * 560 - 454)
    assert nodes["1"]["tknp_dual"] is None and nodes["3"]["tknp_dual"] is None
    assert nodes["4"]["tknp_dual"] == pytest.approx(4 * 560 - 2 * 454)
    assert set(nodes["2"]) == {"dp", "tp", "pp", "dcp", "tknp", "tknp_dual", "tknp_over_dp"}
    assert report["inputs"]["source"] == "measured"


def test_capacity_report_from_preset_bytes_and_table():
    out = _run("capacity_report.py", "--model", "nemotron4-340b", "--nodes", 2, 4,
               "--gpu-memory-gib", 80, "--mem-util", 0.9, "--fp8", "--json").stdout
    report = json.loads(out)
    assert report["inputs"]["source"] == "preset" and report["inputs"]["fp8"] == "all"
    assert report["nodes"]["4"]["tknp"] > report["nodes"]["4"]["dp"] > 0
    table = _run("capacity_report.py", "--model", "llama3.1-405b", "--nodes", 1, 2,
                 "--weights-gib", 454, "--dp-kv-gib", 106).stdout
    assert "tknp_dual" in table and "3.14x" in table


def test_capacity_report_rejects_half_a_measurement():
    proc = _run("capacity_report.py", "--model", "llama3.1-405b", "--weights-gib", 454,
                check=False)
    assert proc.returncode != 0 and "--dp-kv-gib" in proc.stderr


def test_traffic_report_reproduces_section_4_4():
    out = _run("traffic_report.py", "--model", "llama3.1-405b", "--nodes", 4, "--tp", 8,
               "--batch", 128, "--json").stdout
    report = json.loads(out)
    expected = {"scatter_kib_per_owner": 144, "gather_kib_per_owner": 128,
                "dcp_output_kib": 512, "dcp_lse_kib": 8, "tp_allreduce_mib": 4}
    for key, value in expected.items():
        assert report[key] == value and isinstance(report[key], int), key
    assert report["eq3_bytes_per_layer"] == 816 * 1024
    table = _run("traffic_report.py", "--model", "llama3.1-405b", "--nodes", 4,
                 "--batch", 128).stdout
    assert "144 KiB" in table and "4 MiB" in table
