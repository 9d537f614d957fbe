#!/usr/bin/env bash
# The whole Llama-3.1-70B (all 80 layers) with FP8-stored GEMM weights through Transformer
# Engine (tensorwise recipe) on one H200: DP's replica (one GPU is also TP1 and a one-node
# TKNP pool), served against its roofline step (bench_serving's meas/roof, FP8 weights
# counted at one byte). This is the one-GPU half of the full-model rows: two such replicas
# are DP on two H200s, while TKNP there stores one copy across both GPUs.
# One bench_serving invocation: the engine (weights built and filled layer by layer, FP8 from
# the start; KV cache; CUDA graphs) is built once and serves every trace, CONTEXTS x BATCHES
# (256 output tokens); offered batches past the KV capacity run in admission waves.
# SLOTS: request slots (and graph buckets) per GPU; bench_serving's default, the most requests a
# trace offers, never binds and captures no bucket past it (each over 80 layers).
# MIXED: flags of a mixed-length trace added (e.g. "--mixed-requests 24 --mixed-scale 0.5
# --rates 2", the paper's lengths under Poisson arrivals).
# Needs megatron-core 0.16.1 and transformer-engine 2.20.2 on PYTHONPATH (the GPU machine has
# neither: ../shared/DEVICE.md says how to carry them); FA3_SITE as in h200_modes_roofline.sh.
# Usage: OUT=dir [CONTEXTS="8192 32768 65536"] [BATCHES="2 4 16"] [SLOTS=n] [MIXED=flags]
#        [FA3_SITE=dir] [RUN_TIMEOUT=540] bash benchmarks/scripts/h200_full_fp8.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -n "${FA3_SITE:-}" ]; then export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$FA3_SITE"; fi
export PYTHONUNBUFFERED=1
python -c "import torch, megatron.core, transformer_engine; \
print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'TE', transformer_engine.__version__)" 2>&1 | tail -1
start=$(date +%s)
timeout -k 5 ${RUN_TIMEOUT:-540} python -m torch.distributed.run --nproc-per-node 1 -m tknp_megatron.tools.bench_serving \
  --device cuda --model llama3.1-70b --fp8-recipe tensorwise --output-len 256 --cuda-graphs --modes dp \
  ${SLOTS:+--max-requests-per-node $SLOTS} --contexts ${CONTEXTS:-8192 32768 65536} --batches ${BATCHES:-2 4 16} \
  ${MIXED:-} --out "$OUT/full_fp8" > "$OUT/full_fp8.log" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s"
grep -E "^\[|^ +(mode|DP) |rror|Killed" "$OUT/full_fp8.log" | grep -v -i warn | head -40
rm -f "$OUT/full_fp8"/*.png
