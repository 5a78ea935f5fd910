#!/usr/bin/env bash
# One device call (1 GPU, ~12 min): parallelize and CPU offload.
#   (a) peers.py, HF Llama model A at world 1: fsdp8.parallelize (units and plan found by
#       itself) against fsdp8.fully_shard and torch FSDP2, eager and compiled
#   (b) peers.py, model B: fsdp8 ZeRO-3 with and without offload="optim"
#   (c) fsdp8 bench (built-in Llama, model B's width, 2 x 2048 tokens): the deepest stack that
#       trains without offload and with it, near the planner's limits
#   OUT=$OUT bash benchmarks/gpu_manager.sh
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
peers() {  # peers LABEL MODEL STACKS
  timeout -k 20 "$4" torchrun --nproc_per_node 1 benchmarks/peers.py --models "$2" --warmup 2 --steps 6 --stacks "$3" \
    --out "$OUT/peers-$1.json" >"$OUT/peers-$1.log" 2>&1
  echo "($1 exit $?)"; grep -E "^\| (A|B|model)" "$OUT/peers-$1.log" | cut -c1-200; grep -E "failed" "$OUT/peers-$1.log" | head -3 | cut -c1-200
}
peers a A fsdp8-parallelize,fsdp8,fsdp2,fsdp8-parallelize-compile 200
peers b B fsdp8,fsdp8-offload 150
B="--hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 2 --steps 2 --warmup 1"
for run in "16 none" "20 none" "20 optim" "28 optim"; do
  set -- $run
  timeout -k 20 150 python3 -m fsdp8 bench --layers "$1" --offload "$2" $B --json >"$OUT/bench-$1-$2.json" 2>"$OUT/bench-$1-$2.log"
  echo "(bench layers $1 offload $2 exit $?)"
  python3 - "$OUT/bench-$1-$2.json" <<'PY' || tail -n 3 "$OUT/bench-$1-$2.log" | cut -c1-200
import json, sys
d = json.load(open(sys.argv[1])); m, p = d["measured"], d["predicted"]
print({k: (round(m[k], 3) if isinstance(m[k], float) else m[k], round(p.get(k, float("nan")), 3) if isinstance(p.get(k), float) else p.get(k)) for k in m})
PY
done
