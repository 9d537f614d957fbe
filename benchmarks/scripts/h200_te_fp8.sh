#!/usr/bin/env bash
# Transformer Engine layers and FP8-stored weights on one H200 (nvidia-h200), megatron-core
# 0.16.1 + transformer-engine 2.20.2 carried as wheels (docs/ARCHITECTURE.md, "FP8").
# (1) tknp_megatron.tools.check_fp8: tokens against Megatron's own GPTModel per format,
#     memory and KV capacity per format, one 70B layer's dense work BF16 vs FP8;
# (2) the README's FP8 main-job command on one GPU.
# Usage: OUT=dir bash benchmarks/scripts/h200_te_fp8.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -c "import torch, megatron.core, transformer_engine.pytorch as te; \
print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'TE', te.__version__)" 2>&1 | tail -1
timeout 420 torchrun --nproc-per-node 1 -m tknp_megatron.tools.check_fp8 --out "$OUT/check_fp8.json" \
  > "$OUT/check_fp8.log" 2>&1
echo "check_fp8 exit $?"
sed -n '/^== tokens/,$p' "$OUT/check_fp8.log"
grep -a "Error\|error" "$OUT/check_fp8.log" | grep -v -i warn | head -12
timeout 150 torchrun --nproc-per-node 1 examples/run_tknp_decode.py --device cuda --nodes 1 --tp 1 \
  --fp8-recipe tensorwise --requests 8 --output-len 8 --json "$OUT/main_job_fp8.json" \
  > "$OUT/main_job_fp8.log" 2>&1
echo "main job exit $?"
grep -v -i "warn" "$OUT/main_job_fp8.log" | tail -16
