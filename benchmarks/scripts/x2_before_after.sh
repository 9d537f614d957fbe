#!/usr/bin/env bash
# The serving loop of two versions of the code side by side in one run (nvidia-h200-x2):
# BEFORE is a directory holding the older tree (tknp_megatron/, parallel_state/, tools/),
# the current tree is the repository. TKNP and DP at 32K, offered batch 64, 128 output
# tokens, 12 of Llama-3.1-70B's layers under a 34.6 GiB cap; the two versions alternate,
# ROUNDS times each, so drift on the machine shows as spread, not as a difference.
# Usage: OUT=dir BEFORE=dir [ROUNDS=2] bash benchmarks/scripts/x2_before_after.sh
set -u
OUT=${OUT:-out}; ROUNDS=${ROUNDS:-2}; mkdir -p "$OUT"
TR="python -m torch.distributed.run --nproc-per-node 2"
ARGS="--device cuda --model llama3.1-70b --layers 12 --gpu-memory-gib 34.6 --output-len 128 \
  --modes tknp dp --cuda-graphs --contexts 32768 --batches 64"
export PYTHONUNBUFFERED=1
for round in $(seq "$ROUNDS"); do
  echo "== round $round: before"
  (cd "$BEFORE" && PYTHONPATH=$PWD:${SITE:-} timeout 200 $TR tools/bench_serving.py $ARGS \
    --out "$OUT/before_$round") 2>&1 | grep -E "^ +(TKNP|DP) "
  echo "== round $round: after"
  PYTHONPATH=$PWD:${SITE:-} timeout 200 $TR -m tknp_megatron.tools.bench_serving $ARGS \
    --out "$OUT/after_$round" 2>&1 | grep -E "^ +(TKNP|DP) "
done
