#!/usr/bin/env bash
# 4 x H200: TKNP (2,2) and (4,1) against the reference, then the side by
# side (TKNP 2x2, DP 2 x TP2, TP4, PP 2 x TP2, DCP TP4 on a 2-KV-head variant).
# Run from the repo root with megatron-core importable; results under $OUT.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
TR="python -m torch.distributed.run --nproc-per-node 4"
for shape in "2 2" "4 1"; do
  set -- $shape
  for dt in float32 bfloat16; do
    echo "== main job N=$1 T=$2 $dt"
    timeout ${MAIN_TIMEOUT:-80} $TR examples/run_tknp_decode.py --device cuda --nodes $1 --tp $2 --dtype $dt \
      --json "$OUT/main_job_x4_n$1t$2_$dt.json" 2>&1 | grep -v Warning | tail -4
  done
done
echo "== serving"
timeout ${SERVING_TIMEOUT:-260} $TR tknp_megatron/tools/bench_serving.py --device cuda --model llama3.1-70b --layers 8 \
  --tp 2 --dcp-kv-heads 2 --gpu-memory-gib 13.5 --contexts 32768 --batches 16 64 \
  --output-len 64 --modes tknp dp tp pp dcp --cuda-graphs --out "$OUT/serving_x4" 2>&1 \
  | grep -v Warning | tail -30
