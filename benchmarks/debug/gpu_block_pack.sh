#!/usr/bin/env bash
# One device call (1 GPU): the FP8 GPU tests, the both-ways 1x128 kernel variants, the
# gather pack kernels (per weight against one launch per unit), then model A compiled, block
# beside current scaling, each stack in its own process, with a step profile.
#   OUT=$OUT [MODELS="A"] [STACKS=...] [SKIP_TESTS=1] [SKIP_KERNELS=1] [SKIP_PACK=1]
#     [VARIANTS="layouts registers pipelined"] [WARPS=4,8,16] [REPEAT=1] [EXTRA_ARGS=...peers.py flags] bash benchmarks/debug/gpu_block_pack.sh
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null 2>&1
record_env
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q tests/gpu/test_fp8_gpu.py -p no:cacheprovider >"$OUT/gpu-tests.txt" 2>&1
  tail -n 3 "$OUT/gpu-tests.txt"
fi
if [ -z "${SKIP_KERNELS:-}" ]; then
  for v in ${VARIANTS:-layouts}; do timeout 200 python3 benchmarks/debug/both_ways_kernels.py --variants $v --warps ${WARPS:-4,8,16} 2>&1 | grep -v Warn; done >"$OUT/both_ways.txt"
  grep -E "^\||best" "$OUT/both_ways.txt"
  [ -z "${SKIP_PACK:-}" ] && timeout 100 python3 benchmarks/debug/pack_kernels.py 2>&1 | grep -v Warn >"$OUT/pack.txt"; grep -s "^|" "$OUT/pack.txt"
fi
base=$OUT
for rep in $(seq ${REPEAT:-1}); do  # REPEAT: the stacks again, new processes (per-process variance)
  for model in ${MODELS:-A}; do
    mkdir -p "$base/run$rep"
    OUT="$base/run$rep" MODEL=$model STEPS=10 PEERS_ARGS="--skip-packed-check --profile $base/prof/run$rep ${EXTRA_ARGS:-}" \
      STACKS="${STACKS:-fsdp8-fp8-block-compile fsdp8-fp8-current-compile}" bash benchmarks/gpu_fp8_table.sh
    grep -h "host {" "$base/run$rep"/$model-*.log | sed 's/.*\] //' | cut -c1-200
  done
done
runs=$(cd "$OUT" && ls -d run[0-9]* 2>/dev/null)
[ -n "$runs" ] && tar czf "$OUT/runs.tgz" -C "$OUT" $runs && (cd "$OUT" && rm -rf $runs)
rm -f "$OUT"/prof/*/*.json.gz; [ -d "$OUT/prof" ] && tar czf "$OUT/prof.tgz" -C "$OUT" prof && rm -rf "$OUT/prof"
