#!/usr/bin/env bash
# One device call (1 GPU): the FP8 GPU tests, the both-ways 1x128 kernel variants, the
# gather pack kernels (per weight against one launch per unit), then model A compiled, block
# beside current scaling, each stack in its own process, with a step profile.
#   OUT=$OUT [MODELS="A"] [SKIP_KERNELS=1] bash benchmarks/debug/gpu_block_pack.sh
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null 2>&1
record_env
timeout 240 python3 -m pytest -q tests/gpu/test_fp8_gpu.py -p no:cacheprovider >"$OUT/gpu-tests.txt" 2>&1
tail -n 3 "$OUT/gpu-tests.txt"
if [ -z "${SKIP_KERNELS:-}" ]; then
  timeout 200 python3 benchmarks/debug/both_ways_kernels.py 2>&1 | grep -v Warn >"$OUT/both_ways.txt"
  grep -E "^\||best" "$OUT/both_ways.txt"
  timeout 100 python3 benchmarks/debug/pack_kernels.py 2>&1 | grep -v Warn >"$OUT/pack.txt"; grep "^|" "$OUT/pack.txt"
fi
for model in ${MODELS:-A}; do
  MODEL=$model STEPS=10 PEERS_ARGS="--skip-packed-check --profile $OUT/prof" \
    STACKS="${STACKS:-fsdp8-fp8-block-compile fsdp8-fp8-current-compile}" bash benchmarks/gpu_fp8_table.sh
done
rm -f "$OUT"/prof/*.json.gz
