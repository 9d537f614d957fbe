"""Test files again, with another megatron-core version's files first on the path.

Users on Python 3.12 run megatron-core 0.17 to 0.19, whose wheels are for Python 3.12 but
whose Python files import on 3.11; ``tools/bootstrap_env.sh`` unpacks 0.17.1 and 0.19.2
beside the installed 0.16. The server's tests run with both: 0.17 is the first front end
with Quart, its endpoints reporting FAILED requests themselves, merged replies and no PAUSE /
STOP acknowledgements (and a null tokenizer that, as 0.16's does, adds its end id after the
vocabulary); 0.19.2 is the newest. The checkpoint tests run with 0.19.2, which saves the
common state (Megatron-LM's arguments) among the distributed files instead of ``common.pt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def megatron_env(version: str) -> dict:
    """The environment of a process that imports megatron-core ``version``'s files."""
    site = Path(sys.prefix) / f"megatron-core-{version}"
    assert (site / "megatron" / "core").is_dir(), f"{site}: missing; tools/bootstrap_env.sh unpacks it"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    found = subprocess.run([sys.executable, "-c", "import megatron.core; print(megatron.core.__version__)"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert found.stdout.strip().startswith(version), found.stdout + found.stderr[-2000:]
    return env


@pytest.mark.parametrize("version, files", [
    ("0.17.1", ("tests/test_server.py",)),
    ("0.19.2", ("tests/test_server.py",)),
    ("0.19.2", ("tests/test_model_sources.py", "tests/test_checkpoint.py")),
], ids=["server-0.17.1", "server-0.19.2", "checkpoints-0.19.2"])
def test_the_tests_pass_with_another_megatron_core(version, files):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *files], env=megatron_env(version), cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and " passed" in summary and "failed" not in summary and "error" not in summary, (
        proc.stdout[-6000:] + proc.stderr[-2000:])
