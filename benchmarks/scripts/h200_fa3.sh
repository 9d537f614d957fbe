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
#   PART=pages      the MQA gap against SDPA by page size: both kernels (and auto) at 16-, 32- and
#                   64-token pages, 1 and 8 KV heads, B = 32 / 128 / 256, 32K and 128K
#   PART=order      the MQA gap against SDPA by where the pages lie: both kernels (and auto) with
#                   each request's pages in order (as the engine's allocator hands out a fresh
#                   pool), interleaved (requests grown in lockstep) and shuffled, 1 and 8 KV heads
#                   at head dim 128 and 12/1 at 192, B = 32 / 128 / 256, 32K and 128K; FA3 also
#                   with its split count and GQA packing fixed (FA3_VARIANTS)
#   PART=kernels    where the MQA gap against SDPA goes, kernel by kernel: the pages and order
#                   shapes (8/1, 16/1, 64/8 at head dim 128; B = 32 / 128 / 256; 4K, 32K, 128K)
#                   timed as PART=attention, then each column run KCALLS (10) times under
#                   torch.profiler: the Triton launch's plan, attention and merge kernels apart,
#                   FA3's, SDPA's; a summary per shape (benchmarks/scripts/kernel_split.py)
#   PART=prefill    prompts: both kernels (and SDPA, causal over contiguous K/V, where the chunk is
#                   the whole context) on whole 4K and 16K prompts and on 2048-token chunks at
#                   the end of a 32K context, Llama-3.1-70B's and Nemotron-4-340B's heads per rank
#                   at TP 1 and 8 (64/8 and 8/1 at head dim 128, 96/8 and 12/1 at 192); TFLOP/s
#   PART=prompts    the engine on real prompts (no KV fed from outside): bench_served --offline-only,
#                   8 prompts of 16K tokens, 8 output tokens, 12 of Llama-3.1-70B's layers on the one
#                   GPU, with each backend (triton, auto): the prompts' attention in the engine
#   PART=serving-32k the default backend (auto: fa3 from a 32K bound at head dim 128) against
#                   triton, DP on the one GPU, 12 of Llama-3.1-70B's layers, 32K, B = 16 / 32
#   PART=serving-192 triton, fa3 and auto at head dim 192: DP on the one GPU, 2 of Nemotron-4-340B's layers
#                   (96 query / 8 KV heads), 3968-token prompts (with 128 output tokens, the
#                   model's 4096-token limit), B = 128 / 256
# Set up by the caller: megatron-core on PYTHONPATH and the library at
# $FA3_SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (vLLM 0.26.0's wheel, the one of
# vllm_wheels.txt, holds it). The parcel is that one file, 36 MB zipped, made here with
#   python3 -c "import zipfile; w = zipfile.ZipFile('vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl'); \
#     n = 'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so'; w.extract(n, 'x'); \
#     zipfile.ZipFile('.whl_fa3/fa3.zip', 'w', zipfile.ZIP_DEFLATED).write('x/' + n, n)"
# and opened there with
#   python3 -m zipfile -e .whl_fa3/fa3.zip /tmp/fa3   # FA3_SITE defaults to /tmp/fa3
# BACKENDS overrides a serving part's backends (each part's own list by default).
# Usage: OUT=dir [PART="attention pages order prefill prompts serving serving-32k serving-192"] [MODELS="llama nemotron"] [BACKENDS=...] [BATCH=...] [CTX=...] [TP="1 2 8"] bash $0
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
      for tag in ${MODELS:-llama nemotron}; do
        case $tag in llama) group="llama3.1-70b llama3.1-405b" ;; *) group="nemotron4-340b" ;; esac
        timeout -k 5 ${PART_TIMEOUT:-280} python -m tknp_megatron.tools.bench_attention --models $group \
          --tp ${TP:-1 2 8} --batch ${BATCH:-1 8 32 128 256} --ctx ${CTX:-1024 4096 32768 131072} --configs auto \
          --reps 20 --max-kv-gib 24 --out "$OUT/fa3_attention_$tag.json" > "$OUT/fa3_attention_$tag.txt" 2>&1
        echo "$group: exit $?"
        grep "^small cases" "$OUT/fa3_attention_$tag.txt" | tail -n 1
        tail -n 100 "$OUT/fa3_attention_$tag.txt" | grep -v "^{" | tail -n 60
      done ;;
    serving)
      for backend in ${BACKENDS:-triton fa3}; do
        rm -rf "$OUT/serving_$backend"
        timeout -k 5 ${SERVING_TIMEOUT:-240} torchrun --nproc-per-node 1 -m tknp_megatron.tools.bench_serving \
          --device cuda --cuda-graphs --modes dp --model llama3.1-70b --layers 12 --contexts 8192 \
          --batches ${SERVING_BATCH:-16 64 128} --output-len 128 --attention-backend $backend \
          --out "$OUT/serving_$backend" 2>&1 | grep -v Warning | tail -n 9
        rm -f "$OUT/serving_$backend"/*.png
      done ;;
    pages)
      for bs in 16 32 64; do
        timeout -k 5 ${PART_TIMEOUT:-150} python -m tknp_megatron.tools.bench_attention \
          --heads 8:1:128 16:1:128 64:8:128 12:1:192 --batch 32 128 256 --ctx 32768 131072 --configs auto \
          --reps 20 --max-kv-gib 24 --block-size $bs --out "$OUT/pages_$bs.json" > "$OUT/pages_$bs.txt" 2>&1
        echo "block $bs: exit $?"; grep "^small cases:" "$OUT/pages_$bs.txt" | tail -n 1
      done ;;
    order)
      for order in in-order interleaved shuffled; do
        timeout -k 5 ${PART_TIMEOUT:-150} python -m tknp_megatron.tools.bench_attention \
          --heads 8:1:128 16:1:128 64:8:128 12:1:192 --batch ${BATCH:-32 128 256} --ctx ${CTX:-32768 131072} \
          --configs auto --reps 20 --max-kv-gib 24 --page-order $order \
          --fa3-variants ${FA3_VARIANTS:-1 2 4 8 0:pack 0:nopack} \
          --out "$OUT/order_$order.json" > "$OUT/order_$order.txt" 2>&1
        echo "pages $order: exit $?"; grep "^small cases:" "$OUT/order_$order.txt" | tail -n 1
        tail -n 30 "$OUT/order_$order.txt" | grep -v "^{"
      done ;;
    kernels)
      timeout -k 5 ${PART_TIMEOUT:-280} python -m tknp_megatron.tools.bench_attention \
        --heads ${HEADS:-8:1:128 16:1:128 64:8:128} --batch ${BATCH:-32 128 256} --ctx ${CTX:-4096 32768 131072} \
        --configs auto ${CONFIGS:-} --reps 20 --max-kv-gib 24 --kernel-profile ${KCALLS:-10} \
        --out "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
      echo "kernels: exit $?"; grep "^small cases:" "$OUT/kernels.txt" | tail -n 1
      python benchmarks/scripts/kernel_split.py "$OUT/kernels.json" ;;
    prefill)
      for spec in "1 4:4096:4096" "1:16384:16384" "1 4:32768:2048"; do
        IFS=: read -r batches ctx qlen <<< "$spec"
        timeout -k 5 ${PART_TIMEOUT:-200} python -m tknp_megatron.tools.bench_attention \
          --heads 64:8:128 8:1:128 96:8:192 12:1:192 --batch $batches --ctx $ctx --query-len $qlen \
          --configs auto --reps 10 --query-sets 2 --out "$OUT/prefill_${ctx}_$qlen.json" > "$OUT/prefill_${ctx}_$qlen.txt" 2>&1
        echo "prefill ctx $ctx chunk $qlen: exit $?"; grep "^small cases:" "$OUT/prefill_${ctx}_$qlen.txt" | tail -n 1
        tail -n 12 "$OUT/prefill_${ctx}_$qlen.txt" | grep -v "^{"
      done ;;
    prompts)
      for backend in ${BACKENDS:-triton auto}; do
        timeout -k 5 ${SERVING_TIMEOUT:-240} python -m tknp_megatron.tools.bench_served --device cuda --gpus 1 \
          --nodes 1 --tp 1 --model llama3.1-70b --layers 12 --requests ${PROMPTS:-8} --prompt-len ${PROMPT_LEN:-16384} \
          --output-len 8 --passes 2 --offline-only --attention-backend $backend --timeout 230 \
          --out "$OUT/prompts_$backend.json" 2>&1 | grep -v Warning | tail -n 4
      done ;;
    serving-32k)
      for backend in ${BACKENDS:-triton auto}; do
        rm -rf "$OUT/serving32k_$backend"
        timeout -k 5 ${SERVING_TIMEOUT:-240} torchrun --nproc-per-node 1 -m tknp_megatron.tools.bench_serving \
          --device cuda --cuda-graphs --modes dp --model llama3.1-70b --layers 12 --contexts 32768 \
          --batches ${SERVING_BATCH:-16 32} --output-len 128 --attention-backend $backend \
          --out "$OUT/serving32k_$backend" 2>&1 | grep -v Warning | tail -n 9
        rm -f "$OUT/serving32k_$backend"/*.png
      done ;;
    serving-192)
      for backend in ${BACKENDS:-triton fa3 auto}; do
        rm -rf "$OUT/serving192_$backend"
        timeout -k 5 ${SERVING_TIMEOUT:-240} torchrun --nproc-per-node 1 -m tknp_megatron.tools.bench_serving \
          --device cuda --cuda-graphs --modes dp --model nemotron4-340b --layers 2 --contexts 3968 \
          --batches ${SERVING_BATCH:-128 256} --output-len 128 --attention-backend $backend \
          --out "$OUT/serving192_$backend" 2>&1 | grep -v Warning | grep -v "^\[" | tail -n 8
        rm -f "$OUT/serving192_$backend"/*.png
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
