#!/usr/bin/env bash
# FP8 GEMM inputs quantized by the kernels that make them (tknp_megatron/executor/fp8_inputs.py)
# against Transformer Engine quantizing them itself, on one GPU, in one call:
# (1) test: tests/test_fp8_inputs.py (the cast gives TE's quantizer's bits; a Llama layer gives
#     TE's modules' output);
# (2) dense: tools/bench_dense --formats local fp8 (fp8 fused: the inputs quantized here;
#     unfused: TE's modules, Megatron's activation; local: BF16, Megatron's local layers), one Llama-3.1-70B layer at TP 1, and one rank's share of
#     Llama-3.1-405B at the paper's TP 8 (--rank-of-tp 8), with the kernels of each graphed layer;
# (3) tokens: check_fp8 --parts tokens --formats local fp8, fused and --no-fused-elementwise,
#     first tokens against Megatron's GPTModel and against the same model in BF16 (local);
# (4) step: the graphed step of LAYERS (default 80 on an H200, 40 on an H100: the 80 FP8 layers
#     leave an H100 no room for the cache) FP8 Llama-3.1-70B layers
#     (bench_step --profile), with the library of BASE (an absolute path to a tree from before,
#     e.g. `git archive HEAD tknp_megatron | tar -x -C .base`) first where given, then this tree.
# megatron-core 0.16.1 and transformer-engine 2.20.2 on PYTHONPATH (../shared/DEVICE.md).
# Usage: OUT=dir [PARTS="test dense tokens step"] [BATCHES="16 64 128"] [FORMATS="local fp8"] [LAYERS=...]
#        [STEP_BATCHES="2 4 16"] [BASE=dir] bash $0
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T="python -m torch.distributed.run --nproc-per-node 1"
for part in ${PARTS:-test dense tokens step}; do
  echo "== $part"
  case $part in
    test) timeout -k 5 300 python -m pytest -q -p no:cacheprovider tests/test_fp8_inputs.py > "$OUT/test.log" 2>&1
          echo "exit $?"; grep -E "passed|failed|Error|assert" "$OUT/test.log" | cut -c1-3000 | tail -n 12 ;;
    dense)
      for spec in "llama3.1-70b 1" "llama3.1-405b 8"; do
        set -- $spec
        timeout -k 5 240 $T -m tknp_megatron.tools.bench_dense --model $1 --rank-of-tp $2 --formats ${FORMATS:-local fp8} \
          --batches ${BATCHES:-16 64 128} --profile --out "$OUT/dense_$1_tp$2.json" 2>&1 \
          | grep -a -v -i warn > "$OUT/dense_$1_tp$2.log"
        echo "$1 rank of TP $2: exit $?"; sed -n '/format fused/,$p' "$OUT/dense_$1_tp$2.log" | head -n 90
      done ;;
    tokens)
      for f in "" "--no-fused-elementwise"; do
        name=tokens${f:+_unfused}
        timeout -k 5 200 $T -m tknp_megatron.tools.check_fp8 --parts tokens --formats local fp8 $f \
          --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "$name: exit $?"; sed -n '/^== tokens/,$p' "$OUT/$name.log" | grep -v -i warn | head -n 20
      done ;;
    step)
      layers=${LAYERS:-$(python -c "import torch; print(80 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 40)")}
      for tree in ${BASE:+base} this; do
        dir=.; [ "$tree" = base ] && dir=$BASE  # python -m puts the working directory first
        (cd $dir && PYTHONPATH=$PYTHONPATH:$OLDPWD timeout -k 5 ${STEP_TIMEOUT:-240} $T -m tknp_megatron.tools.bench_step \
          --layers $layers --fp8-recipe tensorwise --profile --reps 10 --batches ${STEP_BATCHES:-2 4 16} \
          --contexts 8192 --out "$OUT/step_$tree.json" > "$OUT/step_$tree.txt" 2>&1)
        echo "step, $tree tree: exit $?"
        grep -v "^\[" "$OUT/step_$tree.txt" | grep -vi "warn" | grep -E "^ +[0-9]+ +8192|against the roofline|other|idle|gemm|kernels busy|tokens" | head -n 40
      done ;;
  esac
done
