#!/usr/bin/env bash
# Paged decode attention on one H200, every per-rank shape users run (tknp_megatron.tools.bench_attention):
# Llama-3.1-70B / 405B and Nemotron-4-340B at TP 1, 2, 8 (query/KV heads 64/8, 32/4, 8/1; 128/8, 64/4,
# 16/1; 96/8, 48/4, 12/1 at head dim 192), B 1-256, context 1K-128K, block size 16 (the engine's).
#   PART=sweep  times each launch config in CONFIGS (block_n:num_warps:num_stages) per shape; the
#               first is the backend's choice, so "best_config" says where another one wins
#   PART=check  times the backend's own choice only (the figures in benchmarks/RESULTS.md)
#   EXTRA="--spread 0.9"  mixed lengths (request i of B holds ctx * (1 - 0.9 i / (B - 1)) tokens):
#               how one long request's programs hold up a wave, e.g. with CONFIGS="auto auto@2 auto@4"
#               (uniform slices per request against slices of equal tokens on 2x / 4x the grid)
# Usage: OUT=dir [PART=check] [CONFIGS="64:4:2 ..."] [BATCH=...] [CTX=...] [TP="1 2 8"] [EXTRA=...] \
#        bash benchmarks/scripts/h200_attention.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PART=${PART:-check}
BATCH=${BATCH:-1 8 32 128 256}
CTX=${CTX:-1024 4096 32768 131072}
if [ "$PART" = sweep ]; then
  CONFIGS=${CONFIGS:-64:4:2 64:4:3 64:8:2 128:4:2 128:8:2 32:4:2 32:2:3 32:4:4}
else
  CONFIGS=${CONFIGS:-auto}
fi
for group in "llama3.1-70b llama3.1-405b" "nemotron4-340b"; do
  tag=$(echo "$group" | cut -d' ' -f1)
  timeout -k 5 ${PART_TIMEOUT:-280} python -m tknp_megatron.tools.bench_attention --models $group --tp ${TP:-1 2 8} \
    --batch $BATCH --ctx $CTX --configs $CONFIGS --reps 20 --max-kv-gib 24 ${EXTRA:-} \
    --out "$OUT/attention_${PART}_$tag.json" > "$OUT/attention_${PART}_$tag.txt" 2>&1
  echo "$group: exit $?"
  tail -n 100 "$OUT/attention_${PART}_$tag.txt" | grep -v "^{" | tail -60
done
