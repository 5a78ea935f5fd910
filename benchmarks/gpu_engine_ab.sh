#!/usr/bin/env bash
# One device call (1 GPU, ~6 min): does the tensor-parallel-capable engine cost anything
# without TP? peers.py on model B at world 1, compiled bf16 and compiled FP8 (current
# scaling), with the engine of this checkout and with the engine before TP (an old tree in
# .old/: `git archive b987f0f fsdp8 benchmarks | tar -x -C .old`, carried), in the order
# old, new, new, old so that drift in either direction shows.
#   OUT=$OUT bash benchmarks/gpu_engine_ab.sh        (carry [".old"])
set -uo pipefail
source benchmarks/gpu_env.sh
STACKS=${STACKS:-fsdp8-compile,fsdp8-fp8-current-compile}
run() {  # run TREE LABEL
  (cd "$1" && timeout -k 20 170 torchrun --nproc_per_node 1 benchmarks/peers.py --models B --warmup 2 --steps 8 \
     --stacks "$STACKS" --out "$OUT/peers-$2.json" >"$OUT/peers-$2.log" 2>&1)
  echo "($2 exit $?)"
  grep -E "^\| (B|model)" "$OUT/peers-$2.log" | cut -c1-200
}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run .old old1
run . new1
run . new2
run .old old2
