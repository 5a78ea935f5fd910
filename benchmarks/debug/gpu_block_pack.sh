#!/usr/bin/env bash
# One device call (1 GPU): the FP8 GPU tests, the both-ways 1x128 kernel variants, the
# gather pack kernels (per weight against one launch per unit), then model A compiled, block
# beside current scaling, each stack in its own process, with a step profile.
#   OUT=$OUT [MODELS="A"] [STACKS=...] [SKIP_TESTS=1] [SKIP_KERNELS=1] [SKIP_PACK=1]
#     [VARIANTS="layouts registers pipelined"] [WARPS=4,8,16] bash benchmarks/debug/gpu_block_pack.sh
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
  [ -z "${SKIP_PACK:-}" ] && timeout 100 python3 benchmarks/debug/pack_kernels.py 2>&1 | grep -v Warn >"$OUT/pack.txt"; grep "^|" "$OUT/pack.txt"
fi
for model in ${MODELS:-A}; do
  MODEL=$model STEPS=10 PEERS_ARGS="--skip-packed-check --profile $OUT/prof" \
    STACKS="${STACKS:-fsdp8-fp8-block-compile fsdp8-fp8-current-compile}" bash benchmarks/gpu_fp8_table.sh
done
rm -f "$OUT"/prof/*.json.gz; [ -d "$OUT/prof" ] && tar czf "$OUT/prof.tgz" -C "$OUT" prof && rm -rf "$OUT/prof"
