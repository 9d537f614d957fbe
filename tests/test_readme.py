"""Every command the README shows is run here (CPU forms) or parsed against the tool's own
flags (GPU forms, which benchmarks/scripts run on the GPU machine), and printed output the
README quotes is compared with what the command prints now, so the README cannot drift."""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_job_module, run_main_job

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def fenced_blocks(lang: str = ""):
    """The README's fenced code blocks of language ``lang`` (none by default), each a list
    of lines."""
    blocks, current, current_lang = [], None, None
    for line in README.splitlines():
        if line.startswith("```"):
            if current is None:
                current, current_lang = [], line[3:].strip()
            else:
                if current_lang == lang:
                    blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands():
    """``(command, the lines the block shows after it)`` for every command line of a fenced
    block (continuation lines joined, comments dropped)."""
    out = []
    for lines in fenced_blocks():
        i = 0
        while i < len(lines):
            line = lines[i]
            if re.match(r"(make|python|torchrun) ", line):
                cmd = line
                while cmd.rstrip().endswith("\\"):
                    i += 1
                    cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
                rest = []
                while i + 1 < len(lines) and not re.match(r"(make|python|torchrun) ", lines[i + 1]):
                    i += 1
                    rest.append(lines[i])
                out.append((cmd.split("  #")[0].strip(), rest))
            i += 1
    return out


LAUNCHERS = {  # the example scripts the README runs, and how to load each one's parser
    "examples/run_tknp_decode.py": load_job_module,
    "examples/serve_tknp.py": lambda: load_job_module("serve_tknp"),
}


def _argv(cmd: str):
    """``(entry, argv)``: the module or script a command runs and its arguments."""
    words = shlex.split(cmd)
    if words[0] == "torchrun":
        words = words[words.index("--nproc-per-node") + 2:]
    else:
        words = words[1:]  # python
    if words[0] == "-m":
        return words[1], words[2:]
    return words[0], words[1:]


def test_every_command_is_covered():
    cmds = [c for c, _ in commands()]
    assert "make run" in cmds and "make test" in cmds and "make serve" in cmds
    for cmd in cmds:
        if cmd.startswith("make "):
            continue
        entry, _ = _argv(cmd)
        assert entry.startswith("tknp_megatron.tools.") or entry in LAUNCHERS, cmd


@pytest.mark.parametrize("cmd", [c for c, _ in commands() if c.startswith(("torchrun", "python"))])
def test_flags_parse(cmd):
    """Each command's flags are accepted by its tool (GPU forms are run by the GPU scripts)."""
    entry, argv = _argv(cmd)
    if entry.endswith(".py"):
        LAUNCHERS[entry]().parse_args(argv)
    else:
        module = importlib.import_module(entry)
        module.parse_args(argv)


@pytest.mark.parametrize("tool", ["capacity_report", "traffic_report"])
def test_report_output_is_what_the_readme_shows(tool):
    (cmd, shown), = [(c, rest) for c, rest in commands() if f"tools.{tool} " in c]
    proc = subprocess.run([sys.executable, *shlex.split(cmd)[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [line.rstrip() for line in proc.stdout.strip().splitlines()] == [
        line.rstrip() for line in shown if line.strip()]


def test_make_run_with_flags_and_its_printed_summary():
    """``make run ARGS=...`` as the README shows it, and the deterministic lines of the
    default run's printed summary (timings aside) as the README quotes them."""
    flags = re.search(r'`make run ARGS="([^"]+)"`', README).group(1)
    proc = subprocess.run(["make", "run", f"ARGS={flags} --quiet"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "match_reference: true" in proc.stdout
    (shown,) = [b for b in fenced_blocks() if b and b[0].startswith("TKNP decode:")]
    status, stdout, stderr = run_main_job("--quiet")  # the default run (in this process)
    assert status == 0, stderr[-3000:]
    timed = re.compile(r"throughput|queue wait|max logit diff")
    assert [x for x in stdout.splitlines() if not timed.search(x)] == [
        x for x in shown if not timed.search(x)]
