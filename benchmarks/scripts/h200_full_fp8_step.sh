#!/usr/bin/env bash
# The full Llama-3.1-70B (all 80 layers, FP8-stored GEMM weights through Transformer Engine) on
# one H200: its graphed decode step against its roofline, part by part
# (tknp_megatron.tools.bench_step --profile --fp8-recipe; FP8 weights counted at one byte): the
# GPU kernels grouped into attention, GEMMs, NCCL and the rest, each against the roofline's
# part, and the GPU's idle time. It names what the served full-FP8 rows of h200_full_fp8.sh
# spend beyond their roofline step. KV is sized for the largest batch at the context
# (every request's pages in order).
# Two runs side by side: the rows of each GEMM padded by Megatron's per-linear wrappers
# (--megatron-row-padding, full_fp8_step_megatron_pad.*), then the step's own padding of its
# rows once (the engine's default, full_fp8_step.*; it also checks both give the same tokens).
# On an H100 (78 GiB) the 80 FP8 layers leave no room for the cache: LAYERS=40 (as run on
# 2026-12-06, benchmarks/full_fp8_h100x1/row_padding/).
# Needs megatron-core 0.16.1 and transformer-engine 2.20.2 on PYTHONPATH (../shared/DEVICE.md
# says how to carry them).
# Usage: OUT=dir [BATCHES="2 4 16"] [CONTEXTS=8192] [RECIPE=tensorwise] [LAYERS=80] [RUN_TIMEOUT=300]
#        [PADDINGS="megatron step"] bash benchmarks/scripts/h200_full_fp8_step.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for padding in ${PADDINGS:-megatron step}; do
  name=full_fp8_step; flag=""
  if [ "$padding" = megatron ]; then name=full_fp8_step_megatron_pad; flag=--megatron-row-padding; fi
  timeout -k 5 ${RUN_TIMEOUT:-300} python -m torch.distributed.run --nproc-per-node 1 -m tknp_megatron.tools.bench_step \
    --layers ${LAYERS:-80} --fp8-recipe ${RECIPE:-tensorwise} --profile --reps 10 --batches ${BATCHES:-2 4 16} \
    --contexts ${CONTEXTS:-8192} $flag --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "== $name: exit $?"
  grep -v "^\[" "$OUT/$name.txt" | grep -vi "warn" | tail -n 80
done
