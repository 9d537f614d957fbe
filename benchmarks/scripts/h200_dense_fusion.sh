#!/usr/bin/env bash
# The root's dense work at its GEMM time, on one H200 (nvidia-h200), side by side in one call:
# (1) dense: tknp_megatron.tools.bench_dense: one Llama-3.1-70B layer's dense work per format
#     (FORMATS, default "local"; add "te fp8 fp8-blockwise" where Transformer Engine is on
#     PYTHONPATH), fused element-wise kernels and Megatron's modules, against its linear
#     modules alone and the read-bandwidth floor, with the kernels of each graphed layer;
# (2) serving: DP on one GPU (12 of the 70B's layers, 34.6 GiB cap, 8K context, B = 64 and 16,
#     128 output tokens, CUDA graphs), fused and not, per IMPLS (default "local");
# (3) memory: check_fp8's memory and tokens parts (FP8 weights quantized while loading: the
#     peak while building and loading against its bound, first tokens against Megatron's
#     GPTModel), then the tokens part again with --no-fused-elementwise (Megatron's modules
#     between the GEMMs, as the reference runs them), where Transformer Engine is installed.
# megatron-core (and TE for te/fp8) on PYTHONPATH, carried as wheels (../shared/DEVICE.md).
# Usage: OUT=dir [PARTS="dense serving memory"] [FORMATS="local te fp8 fp8-blockwise"]
#        [IMPLS="local transformer_engine"] [BATCHES="1 16 64 128 256"] bash $0
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T="torchrun --nproc-per-node 1"
for part in ${PARTS:-dense serving}; do
  echo "== $part"
  case $part in
    dense) timeout -k 5 300 $T -m tknp_megatron.tools.bench_dense --formats ${FORMATS:-local} \
             --batches ${BATCHES:-1 16 64 128 256} --profile --out "$OUT/dense.json" 2>&1 \
             | grep -a -v -i warn > "$OUT/dense.log"
           echo "exit $?"; sed -n '/format fused/,/^--/p' "$OUT/dense.log" | head -n 60 ;;
    serving) for impl in ${IMPLS:-local}; do
               for f in "" "--no-fused-elementwise"; do
                 name=dp1_${impl}${f:+_unfused}
                 timeout -k 5 200 $T -m tknp_megatron.tools.bench_serving --device cuda --model llama3.1-70b \
                   --layers 12 --gpu-memory-gib 34.6 --output-len 128 --modes dp --cuda-graphs \
                   --contexts 8192 --batches 64 16 --transformer-impl $impl $f --out "/tmp/$name" \
                   > "$OUT/$name.log" 2>&1
                 echo "$name: exit $?"; cp "/tmp/$name/results.json" "$OUT/$name.json" 2>/dev/null
                 grep -a -E "^ +DP " "$OUT/$name.log" | tail -n 2
               done
             done ;;
    memory) timeout -k 5 300 $T -m tknp_megatron.tools.check_fp8 --parts memory tokens \
              --formats ${MEMORY_FORMATS:-te fp8 fp8-blockwise} --out "$OUT/check_fp8.json" > "$OUT/check_fp8.log" 2>&1
            echo "exit $?"; sed -n '/^== memory/,$p' "$OUT/check_fp8.log"
            timeout -k 5 150 $T -m tknp_megatron.tools.check_fp8 --parts tokens --no-fused-elementwise \
              --formats ${MEMORY_FORMATS:-te fp8 fp8-blockwise} --out "$OUT/check_fp8_unfused.json" \
              > "$OUT/check_fp8_unfused.log" 2>&1
            echo "unfused exit $?"; sed -n '/^== tokens/,$p' "$OUT/check_fp8_unfused.log" ;;
  esac
done
