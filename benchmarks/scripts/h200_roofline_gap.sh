#!/usr/bin/env bash
# A decode step against its roofline, part by part (tknp_megatron.tools.bench_step --profile): the
# graphed step of Llama-3.1-70B's layers on NPROC GPUs (1: DP's replica, or TKNP's one node; 2: a
# TKNP pool of two nodes, or with TP=2 one node of TP2, TP's layout), its GPU kernels grouped
# into attention, GEMMs, NCCL and the rest, each held against the roofline's part
# (analysis.roofline.tknp_step_parts), and the GPU's idle time, split into the host's work
# before the graph's replay (the step's inputs; the engine overlaps it with the step before)
# and the gaps inside the replay (the replay timed alone; the 2026-12-04 run predates it).
# Shapes: 4 layers at B = 64 and 128 x 32K and B = 64 x 64K (the roofline rows' shapes; the step of
# 4 layers has every part of a 12-layer one per layer, the logits once), then 12 layers at B = 16
# and 64 x 32K (the older kernel-profile table's shapes). KV pages are in order per request.
# FA3_SITE: a folder holding vllm/vllm_flash_attn/_vllm_fa3_C*.so (h200_fa3.sh says how to carry
# it); without it the default backend runs the Triton kernel.
# Usage: OUT=dir [NPROC=1] [TP=1] [FA3_SITE=dir] bash benchmarks/scripts/h200_roofline_gap.sh
set -u
OUT=${OUT:-out}; NPROC=${NPROC:-1}; mkdir -p "$OUT"
if [ -n "${FA3_SITE:-}" ]; then export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$FA3_SITE"; fi
export PYTHONUNBUFFERED=1
TR="python -m torch.distributed.run --nproc-per-node $NPROC"
run() {  # name, then bench_step's flags
  local name=$1; shift
  timeout -k 5 ${RUN_TIMEOUT:-200} $TR -m tknp_megatron.tools.bench_step --profile --reps 10 --tp ${TP:-1} "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "== $name: exit $?"
  grep -v "^\[" "$OUT/$name.txt" | grep -vi "warn" | tail -n 80
}
run l4_32k --layers 4 --batches 64 128 --contexts 32768
run l4_64k --layers 4 --batches 64 --contexts 65536
run l12_32k --layers 12 --batches 16 64 --contexts 32768
