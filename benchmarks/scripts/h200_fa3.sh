#!/usr/bin/env bash
# FlashAttention 3 (the fa3 backend: vLLM's build, loaded without vLLM) against the Triton
# kernel on one H200, in the layouts the issue names:
#   PART=attention  tknp_megatron.tools.bench_attention over every per-rank shape users run
#                   (as h200_attention.sh PART=check): its small cases check fa3 against the
#                   torch reference first, then each shape's fa3 column beside triton, SDPA
#                   and the copy ceiling (fa3_us, fa3_rel_err)
#   PART=serving    the engine with each backend, DP on the one GPU (12 of Llama-3.1-70B's
#                   layers, 8K, B = 16 / 64 / 128, 128 output tokens, CUDA graphs): vLLM's TP1
#                   layout of benchmarks/RESULTS.md, "vLLM as a peer again"
# Set up by the caller: megatron-core on PYTHONPATH and the library at
# $FA3_SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (vLLM 0.26.0's wheel, the one of
# vllm_wheels.txt, holds it). The parcel is that one file, 36 MB zipped, made here with
#   python3 -c "import zipfile; w = zipfile.ZipFile('vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl'); \
#     n = 'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so'; w.extract(n, 'x'); \
#     zipfile.ZipFile('.whl_fa3/fa3.zip', 'w', zipfile.ZIP_DEFLATED).write('x/' + n, n)"
# and opened there with
#   python3 -m zipfile -e .whl_fa3/fa3.zip /tmp/fa3   # FA3_SITE defaults to /tmp/fa3
# Usage: OUT=dir [PART="attention serving"] [BATCH=...] [CTX=...] [TP="1 2 8"] bash $0
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
FA3_SITE=${FA3_SITE:-/tmp/fa3}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$FA3_SITE" PYTHONUNBUFFERED=1
timeout -k 5 120 python -c "
import torch, tknp_megatron.attention as a
from tknp_megatron.attention.flash3 import fa3_library_path, fa3_unavailable_reason
print('torch', torch.__version__, 'fa3 library', fa3_library_path(), 'unavailable:', fa3_unavailable_reason())
print('backends on cuda:', a.available_backends('cuda'))" 2>&1 | tail -n 3
for part in ${PART:-attention serving}; do
  case $part in
    attention)
      for group in "llama3.1-70b llama3.1-405b" "nemotron4-340b"; do
        tag=$(echo "$group" | cut -d' ' -f1)
        timeout -k 5 ${PART_TIMEOUT:-280} python -m tknp_megatron.tools.bench_attention --models $group \
          --tp ${TP:-1 2 8} --batch ${BATCH:-1 8 32 128 256} --ctx ${CTX:-1024 4096 32768 131072} --configs auto \
          --reps 20 --max-kv-gib 24 --out "$OUT/fa3_attention_$tag.json" > "$OUT/fa3_attention_$tag.txt" 2>&1
        echo "$group: exit $?"
        grep "^small cases" "$OUT/fa3_attention_$tag.txt" | tail -n 1
        tail -n 100 "$OUT/fa3_attention_$tag.txt" | grep -v "^{" | tail -n 60
      done ;;
    serving)
      for backend in triton fa3; do
        rm -rf "$OUT/serving_$backend"
        timeout -k 5 ${SERVING_TIMEOUT:-240} torchrun --nproc-per-node 1 -m tknp_megatron.tools.bench_serving \
          --device cuda --cuda-graphs --modes dp --model llama3.1-70b --layers 12 --contexts 8192 \
          --batches ${SERVING_BATCH:-16 64 128} --output-len 128 --attention-backend $backend \
          --out "$OUT/serving_$backend" 2>&1 | grep -v Warning | tail -n 8
        rm -f "$OUT/serving_$backend"/*.png
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
