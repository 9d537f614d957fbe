#!/usr/bin/env bash
# The paper's memory regime and the full FP8 Llama-3.1-70B on 2 x H200 (nvidia-h200-x2): every
# mode on the same traces, one bench_serving invocation per part, then the pool simulator's
# prediction for every measured row (simulate_pool --replay of the part's folder, same traces):
# the bare roofline's and with the measured implementation factors. Predicted before the run
# by benchmarks/scripts/predict_x2_regimes.sh.
#   slice32k, slice64k: 12 of Llama-3.1-70B's layers, each GPU capped by --kv-weight-ratio 0.2335,
#       so DP keeps 0.2335 of its weights' bytes for KV, as the paper's 405B FP8 on 8 x H100 does
#       (106 GiB beside a 454 GiB copy); bench_serving prints the cap and the ratio DP kept
#   full32k, full64k: all 80 layers with FP8-stored GEMM weights (--fp8-recipe tensorwise:
#       Transformer Engine on PYTHONPATH), no cap: DP as two full FP8 replicas
#   the 64K parts add the mixed-length trace under Poisson arrivals (as x2_headline.sh's ctx64k)
# Usage: OUT=dir [PARTS="slice32k slice64k full32k full64k"] [MODES=...] [LIMIT=seconds per part] bash $0
# FA3_SITE: a folder holding vllm/vllm_flash_attn/_vllm_fa3_C*.so (h200_fa3.sh says how to carry
# it); when set, the default attention backend (auto) runs FA3 where it was measured faster,
# and bench_serving records each row's attention either way.
set -u
if [ -n "${FA3_SITE:-}" ]; then export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$FA3_SITE"; fi
OUT=${OUT:-out}; mkdir -p "$OUT"
TR="python -m torch.distributed.run --nproc-per-node 2"
MODES=${MODES:-tknp dp tp pp dcp}
SHAPE="--model llama3.1-70b --output-len 256 --dcp-kv-heads 1 --modes $MODES"
T32="--contexts 32768 --batches 128 64 16"
T64="--contexts 65536 --batches 64 16 --mixed-requests 48 --mixed-scale 0.5 --rates 2 8"
for part in ${PARTS:-slice32k slice64k full32k full64k}; do
  case $part in
    slice32k) model="--layers 12"; run="--kv-weight-ratio 0.2335"; sim=""; trace=$T32 ;;
    slice64k) model="--layers 12"; run="--kv-weight-ratio 0.2335"; sim=""; trace=$T64 ;;
    full32k) model=""; run="--fp8-recipe tensorwise"; sim="--fp8-weights"; trace=$T32 ;;
    full64k) model=""; run="--fp8-recipe tensorwise"; sim="--fp8-weights"; trace=$T64 ;;
    *) echo "unknown part $part"; continue ;;
  esac
  echo "== $part"
  timeout -k 10 ${LIMIT:-440} $TR -m tknp_megatron.tools.bench_serving --device cuda --cuda-graphs $SHAPE $model \
    $run $trace --out "$OUT/$part" 2>&1 | grep -v Warning | tail -30
  # a run cut short by the limit still has its finished rows: rebuild the table, then predict them
  [ -f "$OUT/$part/results.json" ] || python -m tknp_megatron.tools.bench_serving $SHAPE $model $trace \
    --report-only --out "$OUT/$part" 2>&1 | tail -12
  for cal in none h200; do  # the bare roofline, then with the measured implementation factors
    python -W ignore -m tknp_megatron.tools.simulate_pool $SHAPE $model $sim $trace --world 2 --calibration $cal \
      --replay "$OUT/$part" --json "$OUT/$part/predicted_$cal.json" 2>&1 | tail -16
  done
done
