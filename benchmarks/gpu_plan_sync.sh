#!/usr/bin/env bash
# One device call (1 GPU, ~8 min):
#   (a) benchmarks/sync_check.py: host synchronisations of an HF Llama training step under
#       fsdp8.parallelize, with skip_packed_sequence_check off and on (sdpa and flash path)
#   (b) the planner at a loopback world of 2 (benchmarks/bench_loopback.py), models A and B,
#       each activation-checkpointing mode, and world 1 without AC for reference
#   OUT=$OUT bash benchmarks/gpu_plan_sync.sh
set -uo pipefail
WHEELS=/dev/null source benchmarks/gpu_env.sh 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
timeout -k 20 300 python3 benchmarks/sync_check.py --json "$OUT/sync.json" 2>"$OUT/sync.log"; echo "(sync_check exit $?)"
A="--layers 16 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 4"
B="--layers 8 --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 2"
summary() {
  python3 - "$1" "$2" <<'PY' || tail -n 3 "${1%.json}.log" | cut -c1-200
import json, sys
text = open(sys.argv[1]).read(); d = json.loads(text[text.index("{"):]); m, p, r = d["measured"], d["predicted"], d["ratio"]
print(f"{sys.argv[2]:<26} step {m['step_ms']:7.1f} / {p['step_ms']:7.1f} ms ({r['step_ms']:.3f})   "
      f"peak {m['peak_allocated_gib']:6.2f} / {p['peak_allocated_gib']:6.2f} GiB ({r['peak_allocated_gib']:.3f})")
PY
}
for model in A B; do
  for ac in none selective full; do
    name="$model-loopback2-$ac"
    timeout -k 20 150 python3 benchmarks/bench_loopback.py --world 2 ${!model} --ac $ac --steps 5 --warmup 2 --json \
      >"$OUT/$name.json" 2>"$OUT/$name.log"; echo "($name exit $?)"; summary "$OUT/$name.json" "$name"
  done
  name="$model-world1-none"
  timeout -k 20 150 python3 -m fsdp8 bench ${!model} --steps 5 --warmup 2 --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "($name exit $?)"; summary "$OUT/$name.json" "$name"
done
