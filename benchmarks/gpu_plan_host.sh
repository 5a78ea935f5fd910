#!/usr/bin/env bash
# One device call (1 GPU, ~7 min), issue 14: `fsdp8 bench` with its host probe (fsdp8/bench_host.py)
# beside the planner, models A and B, each activation-checkpointing mode, world 1 and the
# loopback world of 2 (benchmarks/bench_loopback.py), plus the two host-bound misses of the
# first calibration (A fp8-block full AC; the "small" model). Each line: step measured /
# predicted (ratio), the per-op host model's ratio, peak measured / predicted (ratio).
#   OUT=$OUT [RUNS="A-1-none ..."] bash benchmarks/gpu_plan_host.sh
set -uo pipefail
WHEELS=/dev/null source benchmarks/gpu_env.sh 2>/dev/null
record_env >/dev/null 2>&1; cat "$OUT/env.txt"
A="--layers 16 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 4"
B="--layers 8 --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 2"
SMALL="--layers 8 --hidden 512 --ffn 1536 --heads 8 --kv-heads 4 --vocab 256 --seq-len 1024 --micro-batch 8"
RUNS=${RUNS:-"A-1-none A-1-selective A-1-full A-2-none A-2-selective A-2-full B-1-none B-1-selective B-1-full B-2-none B-2-selective B-2-full A-1-full-block SMALL-1-none"}
mkdir -p "$OUT/runs"
for run in $RUNS; do
  IFS=- read -r model world ac fp8 <<<"$run"
  flags="${!model} --ac $ac --steps 10 --warmup 2 --json ${fp8:+--fp8 $fp8}"
  if [ "$world" = 1 ]; then cmd="python3 -m fsdp8 bench $flags"; else cmd="python3 benchmarks/bench_loopback.py --world $world $flags"; fi
  timeout -k 20 150 $cmd >"$OUT/runs/$run.json" 2>"$OUT/runs/$run.log"; rc=$?
  python3 - "$OUT/runs/$run.json" "$run" <<'PY' || echo "$run failed (exit $rc): $(grep -E 'Error' "$OUT/runs/$run.log" | tail -n 1 | cut -c1-160)"
import json, sys
text = open(sys.argv[1]).read(); d = json.loads(text[text.index("{"):]); m, p, r, h = d["measured"], d["predicted"], d["ratio"], d["host"]
print(f"{sys.argv[2]:<18} step {m['step_ms']:7.1f} / {p['step_ms']:7.1f} ms ({r['step_ms']:.3f}; per-op host model {h['per_op_model_step_ms']:7.1f}, "
      f"{h['per_op_model_ratio']:.3f})  host {h['step_host_ms']:6.1f} ms  peak {m['peak_allocated_gib']:6.2f} / {p['peak_allocated_gib']:6.2f} GiB ({r['peak_allocated_gib']:.3f})")
PY
done
tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
