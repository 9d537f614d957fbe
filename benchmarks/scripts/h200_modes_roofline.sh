#!/usr/bin/env bash
# Every mode that runs on one GPU (DP, TP, PP, TKNP of one node, DCP and with it TKNP-MQA) served at 32K and
# 64K against its roofline step (bench_serving's meas/roof): 4 of Llama-3.1-70B's layers (the
# step replays one graph, so host work weighs as it would at 80 layers only if it is not
# hidden), CUDA graphs, 128 output tokens, offered batches 64 and 128 at 32K and 64 at 64K.
# On one GPU PP is one stage (its loop books a step before it plans the next, so its host
# work is not hidden) and DCP one rank; the two-GPU layouts are x2_*.sh.
# FA3_SITE: a folder holding vllm/vllm_flash_attn/_vllm_fa3_C*.so (h200_fa3.sh says how to carry
# it); when set, the default backend (auto) and DCP's shards run FA3 where it was measured faster.
# Usage: OUT=dir [MODES="tknp dp tp pp dcp"] [FA3_SITE=dir] [RUN_TIMEOUT=280] bash benchmarks/scripts/h200_modes_roofline.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -n "${FA3_SITE:-}" ]; then export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$FA3_SITE"; fi
export PYTHONUNBUFFERED=1
for spec in "32768:64 128" "65536:64"; do
  ctx=${spec%%:*}; batches=${spec#*:}
  timeout -k 5 ${RUN_TIMEOUT:-280} python -m torch.distributed.run --nproc-per-node 1 -m tknp_megatron.tools.bench_serving \
    --device cuda --model llama3.1-70b --layers 4 --gpu-memory-gib 110 --output-len 128 --cuda-graphs \
    --modes ${MODES:-tknp dp tp pp dcp} --contexts $ctx --batches $batches --out "$OUT/ctx$ctx" 2>&1 \
    | grep -E "^ +(mode|TKNP|DP|TP|PP|DCP|TKNP-MQA) "
  rm -f "$OUT/ctx$ctx"/*.png
done
