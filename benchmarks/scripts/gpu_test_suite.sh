#!/usr/bin/env bash
# The test suite on the GPU machine, in one call:
# (1) gpu: the files with tests that run only where CUDA is (attention backends, DCP's and
#     sampling's GPU cases, the FP8 input kernels compiled, the tools' GPU paths) and the
#     Triton interpreter's check, in one pytest process, as a user with a GPU runs them;
# (2) suite: `make test`'s command over the whole suite (test files spread over WORKERS
#     processes), a GPU visible.
# megatron-core 0.16.1, transformer-engine 2.20.2 and the test extras of setup.py on
# PYTHONPATH (../shared/DEVICE.md: wheels carried in parcels).
# Usage: OUT=dir [PARTS="gpu suite"] [WORKERS=12] bash $0
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
GPU_FILES="tests/test_attention.py tests/test_dcp.py tests/test_fp8_inputs.py tests/test_sampling.py
  tests/test_tool_inputs.py tests/test_triton_interpreter.py tests/test_dense_fusion.py"
for part in ${PARTS:-gpu suite}; do
  echo "== $part"
  case $part in
    gpu) timeout -k 5 ${GPU_TIMEOUT:-240} python -m pytest -q -p no:cacheprovider -rfEs $GPU_FILES > "$OUT/gpu.log" 2>&1
         echo "exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu.log" | cut -c1-400 | tail -n 30 ;;
    suite) timeout -k 5 ${SUITE_TIMEOUT:-420} python -m pytest -q -p no:cacheprovider -rfE -n ${WORKERS:-12} \
             --dist loadfile --no-loadscope-reorder --durations=15 tests > "$OUT/suite.log" 2>&1
           echo "exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | cut -c1-400 | tail -n 40 ;;
  esac
done
