#!/usr/bin/env bash
# One device call (1 GPU, ~6 min) for issue 17, model A (hidden 2048, ffn 8192, 16/8 heads):
# where FP8 current scaling loses to bf16 under torch.compile.
#   (1) each linear shape alone, compiled, M = 8192 tokens: bf16 against fp8-current
#   (2) one compiled decoder layer: time, what it saves, top kernels (bf16, fsdp8 FP8)
#   (3) peers.py model A at world 1, each stack in its own process
#   OUT=$OUT bash benchmarks/gpu_fp8_a.sh
set -uo pipefail
WHEELS=/dev/null source benchmarks/gpu_env.sh 2>/dev/null
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee "$OUT/env.txt"
A_SHAPE="--hidden 2048 --ffn 8192"
timeout -k 20 150 python3 benchmarks/fp8_gemm.py --tokens 8192 $A_SHAPE --kv-dim 1024 --recipes ${RECIPES:-fp8-current} --compile-only \
  --out "$OUT/gemm-a.json" 2>"$OUT/gemm-a.log" | tail -n 12
timeout -k 20 200 python3 benchmarks/debug/fp8_layer_profile.py --tokens 8192 $A_SHAPE --heads 16 --kv-heads 8 \
  --kinds ${KINDS:-bf16,fsdp8-fp8-current} --top ${TOP:-25} >"$OUT/layer-a.log" 2>&1; echo "(layer profile exit $?)"
for stack in ${STACKS:-fsdp8-compile fsdp8-fp8-current-compile}; do
  timeout -k 20 150 torchrun --nproc_per_node 1 benchmarks/peers.py --models A --warmup 2 --steps 6 --stacks "$stack" \
    --out "$OUT/peers-$stack.json" >"$OUT/peers-$stack.log" 2>&1
  echo "($stack exit $?)"; grep -E "^\| (A|model)" "$OUT/peers-$stack.log" | cut -c1-200
done
