#!/usr/bin/env bash
# Device calls on 2 GPUs (nvidia-h200-x2), issue 15:
#   PART=tests: the distributed suite over NCCL (TP, CP, parallelize, HF, engine), then
#               fsdp8 bench, model A's sizes, dp 2 against tp 2 with sequence parallelism
#   PART=cp:    fsdp8 bench, model A's sizes at 16k-64k tokens, cp 1 (dp 2) against cp 2,
#               full checkpointing
#   PART=tp:    peers.py TP stacks against FSDP2 + the same torch TP styles, models A and B,
#               each stack in its own process (TP=2 by default; NPROC GPUs, default 2)
# Every bench line: measured / predicted (ratio) for step and peak, and tokens/s/GPU.
#   OUT=$OUT PART=tests bash benchmarks/gpu_2gpu.sh
set -uo pipefail
source benchmarks/gpu_env.sh 2>/dev/null  # .whl carried: torchao for torchao-tp-fp8
record_env >/dev/null 2>&1; grep -v Traceback "$OUT/env.txt" | head -3; nvidia-smi topo -m | head -4
A="--layers 16 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --vocab 32000"
bench() {  # bench NAME FLAGS...
  local name=$1; shift
  timeout -k 20 200 python3 -m fsdp8 bench --nproc 2 --json --steps 6 --warmup 2 "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
  python3 - "$OUT/$name.json" "$name" <<'PY' || echo "$name failed: $(grep -E 'Error|error' "$OUT/$name.log" | tail -n 1 | cut -c1-200)"
import json, sys
t = open(sys.argv[1]).read(); d = json.loads(t[t.index("{"):]); m, p, r = d["measured"], d["predicted"], d["ratio"]
print(f"{sys.argv[2]:<16} {d['setup'][:60]:<60} {m['tokens_per_s_per_gpu']:>8,.0f} tok/s/GPU  step {m['step_ms']:7.1f} / {p['step_ms']:7.1f} ms "
      f"({r['step_ms']:.2f})  peak {m['peak_allocated_gib']:6.2f} / {p['peak_allocated_gib']:6.2f} GiB ({r['peak_allocated_gib']:.3f})  "
      f"exposed {m['exposed_comm_ms']:.1f} / {p['exposed_comm_ms']:.1f} ms")
PY
}
if [ "${PART:-tests}" = tests ]; then
  FSDP8_TEST_BACKEND=nccl timeout -k 20 "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:--x} \
    tests/dist/test_tp.py tests/dist/test_tp_engine.py tests/dist/test_cp.py tests/dist/test_parallelize.py \
    tests/dist/test_hf.py tests/dist/test_engine.py tests/gpu 2>&1 | tee "$OUT/tests.log" | tail -n 15
  [ "${BENCH:-1}" = 1 ] && bench A-dp2 $A --seq-len 2048 --micro-batch 4
  [ "${BENCH:-1}" = 1 ] && bench A-tp2-sp $A --seq-len 2048 --micro-batch 8 --tp 2 --sequence-parallel
fi
if [ "${PART:-tests}" = tp ]; then
  for model in ${MODELS:-A B}; do
    for stack in ${TP_STACK_LIST:-fsdp8-tp fsdp2-tp fsdp8-tp-fp8 torchao-tp-fp8}; do
      timeout -k 20 200 torchrun --nproc_per_node "${NPROC:-2}" benchmarks/peers.py --models "$model" --tp "${TP:-2}" \
        --warmup 2 --steps 6 --stacks "$stack" --skip-packed-check --out "$OUT/tp-$model-$stack.json" >"$OUT/tp-$model-$stack.log" 2>&1
      row=$(grep -E "^\| $model " "$OUT/tp-$model-$stack.log" | cut -c1-160); echo "${row:-$model $stack failed: $(grep -E Error "$OUT/tp-$model-$stack.log" | tail -n 1 | cut -c1-160)}"
    done
  done
elif [ "${PART:-tests}" != tests ] || [ "${CP:-0}" = 1 ]; then
  for seq in ${SEQS:-16384 32768 65536}; do
    [ $seq -le 32768 ] && bench A-$seq-cp1 $A --seq-len $seq --micro-batch 1 --ac full
    bench A-$seq-cp2 $A --seq-len $seq --micro-batch 1 --ac full --cp 2
  done
fi
cd "$OUT" && tar czf "${PART:-tests}.tgz" --remove-files $(ls *.json *.log 2>/dev/null)
