#!/usr/bin/env bash
# The pool simulator's figures in benchmarks/RESULTS.md ("Pool simulator"), on any CPU:
# the replays of the measured H200 runs, then the paper's setups (minutes on one core).
set -eu
OUT=${OUT:-benchmarks/simulator}; mkdir -p "$OUT"
SIM="python -W ignore -m tknp_megatron.tools.simulate_pool"
M="--model llama3.1-70b --layers 12 --world 2 --output-len 256 --dcp-kv-heads 1"
$SIM $M --modes tknp dp tp --contexts 32768 --batches 128 64 16 4 \
    --replay benchmarks/headline_h200x2/serving_x2_ctx32k_run2 --json "$OUT/replay_x2_ctx32k_run2.json" \
    | tee "$OUT/replay_x2_ctx32k_run2.txt"
$SIM $M --contexts 65536 --batches 64 16 4 --mixed-requests 48 --mixed-scale 0.5 --rates 2 8 --burst \
    --replay benchmarks/headline_h200x2/serving_x2_ctx64k_mixed --json "$OUT/replay_x2_ctx64k_mixed.json" \
    | tee "$OUT/replay_x2_ctx64k_mixed.txt"
$SIM --model llama3.1-70b --layers 8 --world 4 --tp 2 --dcp-kv-heads 2 --output-len 64 --contexts 32768 \
    --batches 16 64 --replay benchmarks/issue7_h200x4/serving_x4 --json "$OUT/replay_x4.json" | tee "$OUT/replay_x4.txt"
python -W ignore -m tknp_megatron.tools.simulate_pool --paper --json "$OUT/paper.json" | tee "$OUT/paper.txt"
