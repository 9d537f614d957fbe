#!/usr/bin/env bash
# Megatron's server in front of a TKNP pool with megatron-core 0.19.2 (Python 3.12, the GPU
# machine): (1) with TESTS=1, the CPU server tests (tests/test_server.py, gloo) against
# 0.19.2's coordinator and Quart front end (needs the openai client too); (2) served vs
# offline completion throughput on one fixed trace per output length (128 requests of 32
# prompt tokens, all at once; 8 of Llama-3.1-70B's layers) on the GPU(s)
# (tknp_megatron.tools.bench_served).
# Set up by the caller: megatron-core 0.19.2 and the server wheels (pyzmq, msgpack, quart,
# hypercorn, requests and their dependencies) on PYTHONPATH.
# Usage: OUT=dir NPROC=1|2 [LENS="128 256 1024"] [TESTS=1] bash benchmarks/scripts/h200_served_0192.sh
set -u
OUT=${OUT:-out}; NPROC=${NPROC:-1}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_server.py > "$OUT/server_tests_0192.txt" 2>&1
  grep -a -v -i "warn" "$OUT/server_tests_0192.txt" | grep -a "passed\|failed\|Error\|error\|not ready\|Traceback" | tail -30
fi
for n in ${LENS:-128 256 1024}; do
  timeout -k 5 250 python -m tknp_megatron.tools.bench_served --device cuda --gpus "$NPROC" --nodes "$NPROC" \
    --tp 1 --model llama3.1-70b --layers 8 --requests 128 --prompt-len 32 --output-len "$n" --cuda-graphs \
    --timeout 240 --out "$OUT/served_vs_offline_$n.json" > "$OUT/served_$n.log" 2>&1
  echo "output $n: exit $?"
  grep -a "bench_served\|served /\|^offline \|^served \|ended" "$OUT/served_$n.log" | grep -v -i warn | tail -8
done
