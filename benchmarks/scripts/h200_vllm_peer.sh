#!/usr/bin/env bash
# vLLM's offline engine beside this library's modes: same model geometry (12 of Llama-3.1-70B's
# layers, BF16), same fixed-length traces (B requests of CTX prompt tokens, OUTLEN output tokens,
# all at t = 0, greedy), CUDA graphs on both sides (tknp_megatron.tools.bench_vllm and
# tknp_megatron.tools.bench_serving):
#   NPROC=1  ours: MODES (default dp) on one GPU; vLLM: one engine (TP1)
#   NPROC=2  ours: MODES (default "tknp dp tp") on two GPUs; vLLM: TP2 (one engine over both
#            GPUs) and DP2 (two engines, one per GPU, each serving every other request)
# vLLM prefills the prompts itself while bench_serving ingests their KV (a decode pool), so
# compare the decode figures: vLLM's decode_step_ms_warm (every request decoding, prompts' KV in
# its prefix cache, like ours) and decode_step_ms (both generate calls prefilling) against
# bench_serving's step time; the table printed last puts them side by side.
# vLLM's weights are its "dummy" (random) weights, ours the seeded ones: tokens are not compared.
# vLLM's wheel on PYTHONPATH also holds FlashAttention 3, so our side's default attention (auto)
# runs it where it was measured faster, as vLLM's own engine does (the rows say so); OURS_FLAGS
# "--attention-backend triton" pins the Triton kernel.
#
# Set up by the caller: the wheels of benchmarks/scripts/vllm_wheels.txt (vllm 0.26.0 and what
# its offline path imports, plus megatron-core 0.16.1) installed with `bash /root/stage/install.sh`
# into /tmp/site. The script puts /tmp/site on PYTHONPATH itself (VLLM_SITE to change it).
# Usage: OUT=dir [NPROC=1|2] [CTX="8192"] [BATCH="16 64"] [LAYERS=12] [OUTLEN=128] [MODES=...] \
#        [SKIP_OURS=1 | SKIP_VLLM=1] [VLLM_FLAGS="--warm-decode ..."] [OURS_FLAGS="--no-fused-rope ..."] \
#        bash benchmarks/scripts/h200_vllm_peer.sh
# VLLM_FLAGS defaults to --warm-decode (prefix caching on, distinct prompts for the cold pair, then the
# trace's prompts again from the cache: the full-batch decode step; see bench_vllm's docstring).
# VLLM_FLAGS="" runs exactly the two cold generate calls per trace with prefix caching off.
# Time (nvidia-h200, 2026-12-03, NPROC=1, 8K): ours about 75 s for B = 16 and 64 (OURS_TIMEOUT,
# default 240 s); vLLM 93-117 s to start (import, engine-core spawn, torch.compile of the 12 layers
# from an empty cache: 16-18 s, graph capture) plus four generate calls per trace, two of them
# prefilling B x CTX tokens (4.5 s at B=16, 18 s at 64, 36 s at 128) (VLLM_TIMEOUT, default 300 s);
# with the wheels' install, the vLLM part of B = 16 and 64 took 204 s of one call. With the wheels' install in the
# same 600 s call, SKIP_OURS=1 there and SKIP_VLLM=1 in the next call (the machine keeps /tmp/site
# while warm) is safer; NPROC=2 runs three of these steps and needs splitting the same way.
#
# Seen on the first GPU run (nvidia-h200, 2026-12-03): vllm's kernels load against torch
# 2.11.0+cu130, it picks FLASH_ATTN with FlashAttention 3 and starts with Inductor and CUDA graphs
# (benchmarks/RESULTS.md, "vLLM as a peer"). NPROC=2 has not run yet.
set -u
OUT=${OUT:-out}; NPROC=${NPROC:-1}; mkdir -p "$OUT"
VLLM_SITE=${VLLM_SITE:-/tmp/site}
export PYTHONPATH="$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  TVM_FFI_DISABLE_TORCH_C_DLPACK=1
CTX=${CTX:-8192}; BATCH=${BATCH:-16 64}; LAYERS=${LAYERS:-12}; OUTLEN=${OUTLEN:-128}
if [ "$NPROC" = 1 ]; then MODES=${MODES:-dp}; else MODES=${MODES:-tknp dp tp}; fi
COMMON="--model llama3.1-70b --layers $LAYERS --contexts $CTX --batches $BATCH --output-len $OUTLEN"
timeout -k 5 120 python -c "import torch, vllm, megatron.core; print('torch', torch.__version__, \
'vllm', vllm.__version__, 'megatron-core', megatron.core.__version__, 'gpus', torch.cuda.device_count())" \
  2>&1 | tail -n 3

if [ "${SKIP_OURS:-0}" != 1 ]; then
  rm -rf /tmp/peer_ours
  timeout -k 5 ${OURS_TIMEOUT:-240} torchrun --nproc-per-node "$NPROC" -m tknp_megatron.tools.bench_serving \
    --device cuda --modes $MODES --cuda-graphs $COMMON ${OURS_FLAGS:-} --out /tmp/peer_ours > "$OUT/ours.txt" 2>&1
  echo "ours ($MODES): exit $?"; cp /tmp/peer_ours/results.json "$OUT/ours.json" 2>/dev/null
  grep -a -v -i warn "$OUT/ours.txt" | tail -n 8
fi

vllm_facts() {  # what vLLM logged about its choices (backend, KV, compile, graphs), then the tail
  grep -a -E "attention backend|FlashAttention version|Model loading took|Available KV cache|GPU KV cache size|Maximum concurrency|torch.compile took|Graph capturing finished|init engine|built in" \
    "$1" | cut -c1-220 | tail -n 14
  grep -a -E "Error|Traceback|bench_vllm:" "$1" | tail -n 5
}
if [ "${SKIP_VLLM:-0}" = 1 ]; then
  :
elif [ "$NPROC" = 1 ]; then
  timeout -k 5 ${VLLM_TIMEOUT:-300} python -m tknp_megatron.tools.bench_vllm $COMMON ${VLLM_FLAGS---warm-decode} \
    --out "$OUT/vllm_tp1.json" > "$OUT/vllm_tp1.txt" 2>&1
  echo "vllm tp1: exit $?"; vllm_facts "$OUT/vllm_tp1.txt"
else
  timeout -k 5 ${VLLM_TIMEOUT:-300} python -m tknp_megatron.tools.bench_vllm $COMMON ${VLLM_FLAGS---warm-decode} --tp 2 \
    --out "$OUT/vllm_tp2.json" > "$OUT/vllm_tp2.txt" 2>&1
  echo "vllm tp2: exit $?"; vllm_facts "$OUT/vllm_tp2.txt"
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i timeout -k 5 ${VLLM_TIMEOUT:-300} python -m tknp_megatron.tools.bench_vllm $COMMON \
      ${VLLM_FLAGS---warm-decode} --replicas 2 --replica-index $i --out "$OUT/vllm_dp2_$i.json" > "$OUT/vllm_dp2_$i.txt" 2>&1 &
  done
  wait; echo "vllm dp2: done"; for i in 0 1; do vllm_facts "$OUT/vllm_dp2_$i.txt" | tail -n 4; done
fi

timeout -k 5 60 python - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
ours = {}
try:
    for r in json.load(open(os.path.join(out, "ours.json")))["rows"]:
        ours[(r["mode"], r["context"], r["offered_batch"])] = r
except (OSError, ValueError, KeyError):
    pass
f = lambda v, fmt: "n/a" if v is None else format(v, fmt)
print(f"{'engine':>14} {'ctx':>6} {'B':>4} {'full-B ms':>9} {'cold ms':>8} {'ITL ms':>7} {'warm ITL':>8} "
      f"{'decode tok/s':>12} {'compl tok/s':>11} {'prefill s':>9} {'KV tokens':>10} {'attention':>12}")
for (mode, ctx, b), r in sorted(ours.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    step = r["step_ms_measured"]
    print(f"{'ours ' + mode:>14} {ctx:>6} {b:>4} {f(step, '.2f'):>9} {'':>8} {'':>7} {'':>8} "
          f"{f(step and b / step * 1e3, '.0f'):>12} {f(r['completion_throughput_tok_s'], '.0f'):>11} "
          f"{'(ingest)':>9} {str((r.get('kv_capacity_tokens') or [['n/a']])[0][0]):>10} {'ours':>12}")
for path in sorted(glob.glob(os.path.join(out, "vllm_*.json"))):
    name = "vllm " + os.path.basename(path)[5:-5]
    for r in json.load(open(path))["rows"]:
        warm = r.get("decode_step_ms_warm") is not None
        attention = str(r["attention_backend"]) + ("/FA%s" % r["flash_attn_version"] if r["flash_attn_version"] else "")
        print(f"{name:>14} {r['context']:>6} {r['batch']:>4} {f(r.get('decode_step_ms_warm'), '.2f'):>9} "
              f"{f(r['decode_step_ms'], '.2f'):>8} {f(r['itl_ms_median'], '.2f'):>7} "
              f"{f(r.get('itl_ms_median_warm'), '.2f'):>8} "
              f"{f(r['decode_tok_s_warm'] if warm else r['decode_tok_s'], '.0f'):>12} "
              f"{f(r['completion_tok_s'], '.0f'):>11} {f(r['prefill_s'], '.2f'):>9} "
              f"{str(r['kv_capacity_tokens']):>10} {attention:>12}")
print("full-B ms: every request decoding, no prefill between steps (ours: median ITL; vllm: --warm-decode,"
      " (t_N - t_1) / (N - 1) with the prompts' KV cached). cold ms: vllm's same difference with both runs"
      " prefilling (its last steps run shrinking batches). ITL: median of vLLM's per-request inter-token"
      " times (cold counts prefill-mixed steps). decode tok/s: B / full-B step (vllm: cold where no warm"
      " run). DP2 rows are per replica (half the batch each).")
EOF
