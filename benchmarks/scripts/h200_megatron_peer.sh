#!/usr/bin/env bash
# Megatron-Core's own DynamicInferenceEngine beside this library's modes, same model geometry,
# same seeded weights, same fixed-length traces (tknp_megatron.tools.bench_megatron_engine and
# tknp_megatron.tools.bench_serving), BF16, CUDA graphs on both sides:
#   NPROC=1  ours: MODES (default dp) on one GPU; Megatron: one engine (TP1)
#   NPROC=2  ours: MODES (default "tknp dp tp") on two GPUs; Megatron: TP2 (one engine over both
#            GPUs) and DP2 (two engines, one per GPU, each serving every other request)
# Megatron prefills the prompts itself while bench_serving ingests their KV (a decode pool), so
# compare the decode figures: decode_step_ms / decode_tok_s against bench_serving's step time.
# Set up by the caller: megatron-core 0.19.2 and flash-attn-4 (with nvidia-cutlass-dsl) on
# PYTHONPATH (docs/ARCHITECTURE.md, "Kernels per shape", says which wheels).
# Usage: OUT=dir [NPROC=1|2] [CTX="8192"] [BATCH="16 64"] [LAYERS=12] [OUTLEN=128] [MODES=...] \
#        bash benchmarks/scripts/h200_megatron_peer.sh
set -u
OUT=${OUT:-out}; NPROC=${NPROC:-1}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CTX=${CTX:-8192}; BATCH=${BATCH:-16 64}; LAYERS=${LAYERS:-12}; OUTLEN=${OUTLEN:-128}
if [ "$NPROC" = 1 ]; then MODES=${MODES:-dp}; else MODES=${MODES:-tknp dp tp}; fi
COMMON="--model llama3.1-70b --layers $LAYERS --contexts $CTX --batches $BATCH --output-len $OUTLEN"
python -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
timeout -k 5 ${OURS_TIMEOUT:-240} torchrun --nproc-per-node "$NPROC" -m tknp_megatron.tools.bench_serving \
  --device cuda --modes $MODES --cuda-graphs $COMMON --out /tmp/peer_ours > "$OUT/ours.txt" 2>&1
echo "ours ($MODES): exit $?"; cp /tmp/peer_ours/results.json "$OUT/ours.json" 2>/dev/null
grep -a -v -i warn "$OUT/ours.txt" | tail -n 25
peer() {  # name, the tool's extra flags, then the launcher
  local name=$1 flags=$2; shift 2
  timeout -k 5 ${PEER_TIMEOUT:-250} "$@" -m tknp_megatron.tools.bench_megatron_engine $COMMON --cuda-graphs \
    $flags --out "$OUT/megatron_$name.json" > "$OUT/megatron_$name.txt" 2>&1
  echo "megatron $name: exit $?"; grep -a -v -i warn "$OUT/megatron_$name.txt" | tail -n 12
}
if [ "$NPROC" = 1 ]; then
  peer tp1 "" python
else
  peer tp2 "--tp 2" torchrun --nproc-per-node 2
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i timeout -k 5 ${PEER_TIMEOUT:-250} python -m tknp_megatron.tools.bench_megatron_engine \
      $COMMON --cuda-graphs --replicas 2 --replica-index $i --out "$OUT/megatron_dp2_$i.json" \
      > "$OUT/megatron_dp2_$i.txt" 2>&1 &
  done
  wait; echo "megatron dp2: done"; tail -n 5 "$OUT"/megatron_dp2_*.txt
fi
