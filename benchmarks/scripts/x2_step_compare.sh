#!/usr/bin/env bash
# One fixed configuration timed on nvidia-h200-x2, to compare two versions of the code
# (it must not get slower): the graphed and eager TKNP decode step of 12 of
# Llama-3.1-70B's layers at 32K context (B = 16, 64, 128), then the serving loop for TKNP
# and DP at 32K, offered batch 64, 128 output tokens.
# Usage: OUT=dir bash benchmarks/scripts/x2_step_compare.sh LABEL
set -u
OUT=${OUT:-out}; LABEL=${1:-run}; mkdir -p "$OUT"
TR="python -m torch.distributed.run --nproc-per-node 2"
export PYTHONUNBUFFERED=1
timeout 200 $TR -m tknp_megatron.tools.bench_step --layers 12 --batches 16 64 128 \
  --contexts 32768 --reps 10 --out "$OUT/step_$LABEL.json" 2>&1 | grep -v Warning | tail -8
timeout 240 $TR -m tknp_megatron.tools.bench_serving --device cuda --model llama3.1-70b \
  --layers 12 --gpu-memory-gib 34.6 --output-len 128 --modes tknp dp --cuda-graphs \
  --contexts 32768 --batches 64 --out "$OUT/serving_$LABEL" 2>&1 | grep -v Warning | tail -5
