#!/usr/bin/env bash
# The Triton kernel's balanced splits merged by the last program of each request and KV head
# (TritonConfig.fused_merge, the default) against the merge kernel launched after the attention
# kernel, on one GPU (H100 or H200). First the GPU tests: eight layers' calls on one step's
# plan replayed 50 times from a CUDA graph give the separate merge's output and the
# reference's, with the plan's counters zero again; then bench_attention --prepared
# --separate-merge on the backend's own launch per shape (--configs auto, as the engine runs it;
# launches of more than 16 slices a request keep the merge kernel in both columns), each
# shape's calls timed in turn from CUDA graphs, their kernels profiled: triton_prepared_us
# (merged in the kernel, the step's plan, as an engine step runs it) beside
# triton_separate_merge_us (the merge kernel, the same plan), SDPA over contiguous KV and a
# copy. Shapes: Llama-3.1-70B at TP 8 (8/1 query/KV heads) and TP 1 (64/8), Nemotron-4-340B at
# TP 8 (12/1 at head dim 192); B = 32 / 128 / 256; 4K and 32K; 16-token pages.
# Usage: OUT=dir [BENCH_TIMEOUT=400] bash benchmarks/scripts/gpu_fused_merge.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout -k 5 200 python -m pytest -q -rs -p no:cacheprovider tests/test_attention.py -k "merges_in or steps_plan" \
  > "$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -4 "$OUT/tests.log"
timeout -k 5 ${BENCH_TIMEOUT:-400} python -m tknp_megatron.tools.bench_attention --heads 8:1:128 12:1:192 64:8:128 \
  --batch 32 128 256 --ctx 4096 32768 --configs auto --prepared --separate-merge --reps 20 --max-kv-gib 24 --kernel-profile 5 \
  --out "$OUT/fused_merge.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; tail -4 "$OUT/bench.log"
python - "$OUT/fused_merge.json" <<'PY' 2>&1 | tail -24
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("status") == "ok"]
print("B ctx heads launch | merged in kernel / merge kernel (us, step's plan) | ratio | sdpa | copy")
for r in rows:
    a, b = r.get("triton_prepared_us", float("nan")), r.get("triton_separate_merge_us", float("nan"))
    print(r["B"], r["ctx"], f"{r['hq']}/{r['hkv']}/{r['head_dim']}", r["launch"], f"{a:.1f} / {b:.1f}",
          f"{a / b:.3f}", f"{r.get('sdpa_us', float('nan')):.1f}", f"{r.get('copy_us', float('nan')):.1f}")
PY
