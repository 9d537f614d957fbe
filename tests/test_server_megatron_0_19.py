"""The server's tests (``tests/test_server.py``) again, with megatron-core 0.19.2's files
first on the path: the front end of megatron-core 0.17 and later (Quart, its endpoints
reporting FAILED requests themselves, merged replies, no PAUSE / STOP acknowledgements),
which users on Python 3.12 run. Its wheel is for Python 3.12, but its Python files import
on 3.11; ``tools/bootstrap_env.sh`` unpacks them into the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.19.2"


def test_the_server_tests_pass_with_megatron_core_0_19():
    site = Path(sys.prefix) / f"megatron-core-{VERSION}"
    assert (site / "megatron" / "core").is_dir(), f"{site}: missing; tools/bootstrap_env.sh unpacks it"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    version = subprocess.run([sys.executable, "-c", "import megatron.core; print(megatron.core.__version__)"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert version.stdout.strip().startswith(VERSION), version.stdout + version.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "tests/test_server.py"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and " passed" in summary and "failed" not in summary and "error" not in summary, (
        proc.stdout[-6000:] + proc.stderr[-2000:])
