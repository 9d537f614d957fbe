#!/usr/bin/env bash
# The pool simulator's predictions for x2_paper_regime.sh's traces, before they are measured
# (any CPU, minutes): every mode on 2 x H200, each mode's KV from the capacity model.
#   slice: 12 of Llama-3.1-70B's layers at DP's KV / weights = 0.2335 (the paper's regime)
#   full_fp8: all 80 layers, FP8 GEMM weights, 125 GiB per GPU for weights and KV (an H200's
#       139.8 GiB at the engine's 0.9 memory utilisation, less about 1 GiB of runtime)
# Step times: the bare roofline (CALIBRATION=none, the default) or with the measured H200 x2
# implementation factors (CALIBRATION=h200; PP's and DCP's were measured when they ran eagerly).
# Usage: OUT=dir [CALIBRATION=none|h200] bash benchmarks/scripts/predict_x2_regimes.sh
set -eu
OUT=${OUT:-benchmarks/simulator/x2_regimes}; mkdir -p "$OUT"
SIM="python -W ignore -m tknp_megatron.tools.simulate_pool --model llama3.1-70b --world 2 --output-len 256 \
  --dcp-kv-heads 1 --modes tknp dp tp pp dcp --calibration ${CALIBRATION:-none}"
T32="--contexts 32768 --batches 128 64 16"
T64="--contexts 65536 --batches 64 16 --mixed-requests 48 --mixed-scale 0.5 --rates 2 8"
for part in slice32k slice64k full32k full64k; do
  case $part in
    slice32k) flags="--layers 12 --kv-weight-ratio 0.2335 $T32" ;;
    slice64k) flags="--layers 12 --kv-weight-ratio 0.2335 $T64" ;;
    full32k) flags="--fp8-weights --gpu-memory-gib 125 $T32" ;;
    full64k) flags="--fp8-weights --gpu-memory-gib 125 $T64" ;;
  esac
  echo "== $part"
  $SIM $flags --json "$OUT/$part.json" | tee "$OUT/$part.txt" | grep -E "^predicted|^ +(TKNP|DP) "
done
