#!/usr/bin/env bash
# Transformer Engine layers and FP8-stored weights on one H200 (nvidia-h200), with
# megatron-core 0.16.1 and transformer-engine 2.20.2 on PYTHONPATH (carried as wheels: the
# GPU machine has neither). Design: docs/ARCHITECTURE.md, "FP8 on the root".
# (1) tknp_megatron.tools.check_fp8: tokens against Megatron's own GPTModel per format,
#     memory and KV capacity per format, one 70B layer's dense work BF16 vs FP8;
# (2) the README's FP8 main-job command on one GPU;
# (3) with CKPT and EXPECTED set (a trained model's BF16 checkpoint and transformers' greedy
#     tokens, as benchmarks/scripts/x2_trained_agreement.sh prepares them): tokens per format
#     and every mode on one GPU against them;
# (4) DP on one GPU at 32K, 12 of Llama-3.1-70B's layers, per format (bench_serving);
# (5) dcp: DCP's own QKV layer per format (check_fp8 --parts dcp: the one-KV-head variant,
#     against Megatron's GPTModel and TKNP), then DCP and TKNP-MQA on one GPU at 32K, 12 of
#     Llama-3.1-70B's layers with one KV head, per format (bench_serving).
# Usage: OUT=dir [CKPT=dir EXPECTED=file] [PARTS="check main trained serving dcp"]
#        [DCP_FORMATS="local te fp8 fp8-blockwise"] [DCP_SERVING= (empty: skip its serving rows)] bash $0
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T="torchrun --nproc-per-node 1"
python -c "import torch, megatron.core, transformer_engine; \
print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'TE', transformer_engine.__version__)" 2>&1 | tail -1
for part in ${PARTS:-check main}; do
  echo "== $part"
  case $part in
    check) timeout 420 $T -m tknp_megatron.tools.check_fp8 --out "$OUT/check_fp8.json" > "$OUT/check_fp8.log" 2>&1
           echo "exit $?"; sed -n '/^== tokens/,$p' "$OUT/check_fp8.log" ;;
    main) timeout 150 $T examples/run_tknp_decode.py --device cuda --nodes 1 --tp 1 \
            --fp8-recipe tensorwise --requests 8 --output-len 8 --json "$OUT/main_job_fp8.json" \
            > "$OUT/main_job_fp8.log" 2>&1
          echo "exit $?"; grep -v -i "warn" "$OUT/main_job_fp8.log" | tail -16 ;;
    trained) timeout 330 $T -m tknp_megatron.tools.check_fp8 --load "$CKPT" --expected "$EXPECTED" \
               --parts tokens modes --formats local te fp8-blockwise fp8 --out "$OUT/fp8_trained.json" \
               > "$OUT/fp8_trained.log" 2>&1
             echo "exit $?"; sed -n '/^== tokens/,$p' "$OUT/fp8_trained.log" ;;
    serving) for f in "--transformer-impl local" "--transformer-impl transformer_engine" \
                      "--fp8-recipe tensorwise" "--fp8-recipe blockwise"; do
               timeout 240 $T -m tknp_megatron.tools.bench_serving --device cuda --model llama3.1-70b \
                 --layers 12 --gpu-memory-gib 34.6 --output-len 256 --modes dp --cuda-graphs \
                 --contexts 32768 --batches 32 $f --out "$OUT/dp1/${f##* }" 2>&1 | grep -v -i warn | tail -3
             done ;;
    dcp) timeout 300 $T -m tknp_megatron.tools.check_fp8 --parts dcp --formats ${DCP_FORMATS:-local te fp8 fp8-blockwise} \
           --out "$OUT/check_dcp.json" > "$OUT/check_dcp.log" 2>&1
         echo "exit $?"; sed -n '/^== dcp/,$p' "$OUT/check_dcp.log"
         [ -n "${DCP_SERVING-1}" ] && for f in "--transformer-impl local" "--transformer-impl transformer_engine" "--fp8-recipe tensorwise"; do
           echo "-- $f"
           timeout 200 $T -m tknp_megatron.tools.bench_serving --device cuda --model llama3.1-70b \
             --layers 12 --gpu-memory-gib 34.6 --output-len 128 --modes dcp --cuda-graphs \
             --contexts 32768 --batches 64 $f --out "$OUT/dcp1/${f##* }" 2>&1 | grep -E "^ +(mode|DCP|TKNP-MQA) |rror"
         done ;;
  esac
done
