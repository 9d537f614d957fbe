#!/usr/bin/env bash
# Host work per decode step (bench_serving's host_p50), every mode, two versions of the code
# side by side in one run: BEFORE is a directory holding the older tree (tknp_megatron/,
# parallel_state/), the current tree is the repository. 4 of Llama-3.1-70B's layers (host work
# does not grow with layers: the step replays one graph), 8K context, offered batch 64,
# 128 output tokens, CUDA graphs, NPROC GPUs (1 on nvidia-h200).
# EXTRA: more bench_serving flags for both (e.g. "--transformer-impl local" where TE is installed:
# the older tree builds DCP's layers locally whatever is installed).
# Usage: OUT=dir BEFORE=dir [NPROC=1] [EXTRA=flags] bash benchmarks/scripts/h200_host_work.sh
set -u
OUT=${OUT:-out}; NPROC=${NPROC:-1}; mkdir -p "$OUT"
TR="python -m torch.distributed.run --nproc-per-node $NPROC"
ARGS="--device cuda --model llama3.1-70b --layers 4 --gpu-memory-gib 40 --output-len 128 \
  --modes tknp dp tp pp dcp --cuda-graphs --contexts 8192 --batches 64 ${EXTRA:-}"
export PYTHONUNBUFFERED=1
echo "== after"
PYTHONPATH=$PWD:${SITE:-}${PYTHONPATH:+:$PYTHONPATH} timeout -k 5 ${RUN_TIMEOUT:-280} $TR -m tknp_megatron.tools.bench_serving $ARGS \
  --out "$OUT/after" 2>&1 | grep -E "^ +(mode|TKNP|DP|TP|PP|DCP|TKNP-MQA) "
if [ -n "${BEFORE:-}" ]; then
  echo "== before"
  (cd "$BEFORE" && PYTHONPATH=$PWD:${SITE:-}${PYTHONPATH:+:$PYTHONPATH} timeout -k 5 ${RUN_TIMEOUT:-280} $TR -m tknp_megatron.tools.bench_serving \
    $ARGS --out "$OUT/before") 2>&1 | grep -E "^ +(mode|TKNP|DP|TP|PP|DCP|TKNP-MQA) "
fi
