#!/usr/bin/env bash
# The headline run on 2 x H200: every mode on the same traces, one invocation per part.
# 12 of Llama-3.1-70B's layers (23 GiB of bf16 weights with embedding and output layer),
# each GPU capped at 34.6 GiB so one copy takes two thirds of a GPU, as a full
# 56-layer / 93 GiB configuration would; output 256 tokens.
# PARTS (space-separated, in order): step ctx32k ctx64k; MODES overrides the modes;
# LIMIT32 / LIMIT64 the seconds each part may run (finished rows stay in partial.jsonl).
# FA3_SITE: a folder holding vllm/vllm_flash_attn/_vllm_fa3_C*.so (h200_fa3.sh says how to carry
# it); when set, the default attention backend (auto) runs FA3 where it was measured faster,
# and bench_serving records each row's attention either way.
set -u
if [ -n "${FA3_SITE:-}" ]; then export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$FA3_SITE"; fi
OUT=${OUT:-out}; mkdir -p "$OUT"
TR="python -m torch.distributed.run --nproc-per-node 2"
COMMON="--device cuda --model llama3.1-70b --layers 12 --gpu-memory-gib 34.6 --output-len 256 \
  --dcp-kv-heads 1 --modes ${MODES:-tknp dp tp pp dcp} --cuda-graphs"
for part in ${PARTS:-step ctx32k}; do
  echo "== $part"
  case $part in
    step) timeout ${STEP_LIMIT:-150} $TR tknp_megatron/tools/bench_step.py --layers 12 --batches 16 64 \
            --contexts 32768 --reps 10 --profile --out "$OUT/bench_step_x2_l12.json" ;;
    ctx32k) timeout ${LIMIT32:-440} $TR tknp_megatron/tools/bench_serving.py $COMMON --contexts 32768 \
              --batches 128 64 16 4 --out "$OUT/serving_x2_ctx32k" ;;
    ctx64k) timeout ${LIMIT64:-440} $TR tknp_megatron/tools/bench_serving.py $COMMON --contexts 65536 \
              --batches 64 16 4 --mixed-requests 48 --mixed-scale 0.5 --rates 2 8 --burst \
              --out "$OUT/serving_x2_ctx64k_mixed" ;;
  esac 2>&1 | grep -v Warning | tail -45
done
