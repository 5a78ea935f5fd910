#!/usr/bin/env bash
# One device call (1 GPU, ~7 min) for issue 17: the FP8 recipes under torch.compile at world 1.
#   (1) one compiled decoder layer of MODEL (A or B): time, saved tensors, top kernels per KINDS
#   (2) peers.py, each stack of STACKS in its own process, for each model of MODELS
#   OUT=$OUT [MODEL=B] [KINDS=...] [STACKS=...] [MODELS="B A"] bash benchmarks/gpu_fp8_recipes.sh
#   (carry .whl with the torchao wheel for the torchao rows)
set -uo pipefail
source benchmarks/gpu_env.sh
record_env
MODEL=${MODEL:-B}
if [ "$MODEL" = A ]; then SIZES="--tokens 8192 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8"; else SIZES="--tokens 4096"; fi
timeout -k 20 240 python3 benchmarks/debug/fp8_layer_profile.py $SIZES \
  --kinds ${KINDS:-bf16,fsdp8-fp8-current,fsdp8-fp8-block,torchao-float8} --top ${TOP:-25} >"$OUT/layer-$MODEL.log" 2>&1
echo "(layer profile $MODEL exit $?)"; grep -E "^## .* (ms fwd|saved for)" "$OUT/layer-$MODEL.log"
for model in ${MODELS:-B A}; do
  for stack in ${STACKS:-fsdp8-compile fsdp8-fp8-current-compile fsdp8-fp8-block-compile torchao-compile}; do
    timeout -k 20 150 torchrun --nproc_per_node 1 benchmarks/peers.py --models "$model" --warmup 2 --steps 6 \
      --stacks "$stack" --out "$OUT/peers-$model-$stack.json" >"$OUT/peers-$model-$stack.log" 2>&1
    echo "($model $stack exit $?)"; grep -E "^\| $model " "$OUT/peers-$model-$stack.log" | cut -c1-200
  done
done
