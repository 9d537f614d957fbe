#!/usr/bin/env bash
# Megatron's server in front of a TKNP pool with megatron-core 0.19.2 (Python 3.12, the GPU
# machine): (1) with TESTS=1, the CPU server tests (tests/test_server.py, gloo) against
# 0.19.2's coordinator and Quart front end (needs the openai client too); (2) served vs
# offline completion throughput on one fixed trace per output length (128 requests of 32
# prompt tokens, all at once; 8 of Llama-3.1-70B's layers) on the GPU(s)
# (tknp_megatron.tools.bench_served), for each variant in VARIANTS:
#   now      the current tree as it serves by default
#   1http    the current tree with one HTTP process (--frontend-replicas 1)
#   lazy     the current tree capturing each graph bucket on first use (--lazy-graph-capture)
#   nofreeze the current tree leaving the built engine's heap to the garbage collector (--no-gc-freeze)
#   before   the tree in directory BEFORE (an older version, run as it was)
# Set up by the caller: megatron-core 0.19.2 and the server wheels (pyzmq, msgpack, quart,
# hypercorn, aiohttp, requests and their dependencies) on PYTHONPATH.
# Usage: OUT=dir NPROC=1|2 [LENS="128 256 1024"] [VARIANTS="now before"] [BEFORE=dir] [TESTS=1] \
#        bash benchmarks/scripts/h200_served_0192.sh
set -u
OUT=${OUT:-out}; NPROC=${NPROC:-1}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_server.py > "$OUT/server_tests_0192.txt" 2>&1
  grep -a -v -i "warn" "$OUT/server_tests_0192.txt" | grep -a "passed\|failed\|Error\|error\|not ready\|Traceback" | tail -30
fi
HERE=$PWD
for n in ${LENS:-128 256 1024}; do
  for v in ${VARIANTS:-now}; do
    dir=$HERE; extra=""
    case $v in
      1http) extra="--frontend-replicas 1" ;;
      lazy) extra="--lazy-graph-capture" ;;
      nofreeze) extra="--no-gc-freeze" ;;
      before) dir=${BEFORE:?BEFORE=dir for the before variant} ;;
    esac
    (cd "$dir" && PYTHONPATH=$dir:${PYTHONPATH:-} timeout -k 5 250 python -m tknp_megatron.tools.bench_served \
      --device cuda --gpus "$NPROC" --nodes "$NPROC" --tp 1 --model llama3.1-70b --layers 8 --requests 128 \
      --prompt-len 32 --output-len "$n" --cuda-graphs --timeout 240 $extra \
      --out "$OUT/served_${v}_$n.json") > "/tmp/served_${v}_$n.log" 2>&1
    echo "output $n, $v: exit $?" | tee -a "$OUT/served_logs.txt"
    grep -a -v -i warn "/tmp/served_${v}_$n.log" >> "$OUT/served_logs.txt"
    grep -a "ended\|served /\|^offline \|^served \|served pass" "/tmp/served_${v}_$n.log" | grep -v -i warn | tail -8
  done
done
