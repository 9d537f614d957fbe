#!/usr/bin/env bash
# The attention kernel's schedule made once per step (AttentionBackend.prepare: the Triton
# kernel's balanced split plan; FA3's calls schedule themselves, flash3.py says why) against
# each call scheduling itself, on one GPU. First the GPU tests of the kernels running a step's
# layers on the step's schedule (same output as each call scheduling itself, and the
# reference's), then bench_attention --prepared (each kernel's call on the step's schedule,
# *_prepared_us, timed in turn beside the call that schedules itself) over the one-KV-head
# shapes where the Triton kernel balances its splits: Llama-3.1-70B at TP 8 (8/1 query/KV heads)
# and Nemotron-4-340B at TP 8 (12/1 at head dim 192), B = 128 / 256, 4K and 32K, 16-token pages.
# FA3_SITE: a folder holding vllm/vllm_flash_attn/_vllm_fa3_C*.so (h200_fa3.sh says how to carry it).
# Usage: OUT=dir [FA3_SITE=dir] [BENCH_TIMEOUT=240] bash benchmarks/scripts/h200_prepared.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -n "${FA3_SITE:-}" ]; then export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$FA3_SITE"; fi
export PYTHONUNBUFFERED=1
timeout -k 5 150 python -m pytest -q -rs tests/test_attention.py -k "schedule or plan or library or auto or themselves" \
  > "$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -4 "$OUT/tests.log"
timeout -k 5 ${BENCH_TIMEOUT:-240} python -m tknp_megatron.tools.bench_attention --heads 8:1:128 12:1:192 \
  --batch 128 256 --ctx 4096 32768 --prepared --reps 20 --max-kv-gib 24 --out "$OUT/prepared.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; tail -22 "$OUT/bench.log"
python - "$OUT/prepared.json" <<'PY' 2>&1 | tail -20
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("status") == "ok"]
print("B ctx heads | triton graph / prepared (us) | fa3 / prepared | auto / prepared | sdpa")
for r in rows:
    cells = [f"{r.get(a, float('nan')):.1f}/{r.get(b, float('nan')):.1f}" for a, b in
             (("triton_graph_us", "triton_prepared_us"), ("fa3_us", "fa3_prepared_us"), ("auto_us", "auto_prepared_us"))]
    print(r["B"], r["ctx"], f"{r['hq']}/{r['hkv']}/{r['head_dim']}", *cells, f"{r.get('sdpa_us', float('nan')):.1f}")
PY
