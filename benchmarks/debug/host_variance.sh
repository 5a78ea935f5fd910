#!/usr/bin/env bash
# Why a host-bound bench run (model A, selective checkpointing) takes 196 ms in one process and
# 245 in the next: each run's timed steps and host-probe steps, with Python's garbage
# collector on (default) and off, at world 1 and the loopback world 2.
#   OUT=$OUT bash benchmarks/debug/host_variance.sh
set -uo pipefail
WHEELS=/dev/null source benchmarks/gpu_env.sh 2>/dev/null
lscpu | grep -E "^(CPU\(s\)|Model name|NUMA node|Thread|Core|Socket)" ; nproc
A="--layers 16 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 4 --ac selective --steps 8 --warmup 2 --json"
show() {
  python3 - "$1" "$2" <<'PY' || tail -n 3 "${1%.json}.log"
import json, sys
t = open(sys.argv[1]).read(); d = json.loads(t[t.index("{"):]); h = d["host"]
probe = ["/".join(f"{total:.0f}" for _, total in depth) for depth in h["probe_steps_ms"]]
print(f"{sys.argv[2]:<22} steps {' '.join(f'{s:.0f}' for s in d['steps_ms'])} | predicted {d['predicted']['step_ms']:.0f} "
      f"(ratio {d['ratio']['step_ms']:.2f}) host {h['step_host_ms']:.0f} | probe {' ; '.join(probe)}")
PY
}
for i in 1 2 3; do
  for world in 1 2; do
    for gc in on off; do
      name="w$world-gc$gc-$i"
      python3 -c "
import gc, sys
sys.path[:0] = ['benchmarks', '.']
if '$gc' == 'off': gc.disable()
import bench_loopback
bench_loopback.main(['--world', '$world'] + sys.argv[1:])" $A >"$OUT/$name.json" 2>"$OUT/$name.log"
      show "$OUT/$name.json" "$name"
    done
  done
done
tar czf "$OUT/variance.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls w*.json w*.log)
