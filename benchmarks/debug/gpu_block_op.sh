#!/usr/bin/env bash
# One device call (1 GPU): block scaling's in-graph Triton quantization (FSDP8_TRITON_OP) and
# block amax kernel: GPU tests, the isolated kernels, then models A and B compiled, block
# beside current scaling, each stack in its own process (MODELS="A B", OP_OFF=1 adds block
# with the op off).
#   OUT=$OUT bash benchmarks/debug/gpu_block_op.sh
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null 2>&1
record_env
python3 -m pytest -q -x tests/gpu/test_fp8_gpu.py -k "both_ways or block_amax or compiled_float8" -p no:cacheprovider \
  >"$OUT/gpu-tests.txt" 2>&1; tail -n 3 "$OUT/gpu-tests.txt"
python3 benchmarks/debug/block_amax_kernels.py 2>&1 | grep -v Warn >"$OUT/grids.txt"; grep "^|" "$OUT/grids.txt" | head -5
python3 benchmarks/debug/block_quant_compile.py 2>&1 | grep -v Warn >"$OUT/quant.txt"; grep "^|" "$OUT/quant.txt"
for model in ${MODELS:-A}; do
  MODEL=$model STEPS=10 PEERS_ARGS="--skip-packed-check --profile $OUT/prof" \
    STACKS="fsdp8-fp8-block-compile fsdp8-fp8-current-compile" bash benchmarks/gpu_fp8_table.sh
  if [ -n "${OP_OFF:-}" ]; then
    mkdir -p "$OUT/op-off"
    FSDP8_TRITON_OP=0 OUT="$OUT/op-off" MODEL=$model STEPS=10 PEERS_ARGS=--skip-packed-check \
      STACKS="fsdp8-fp8-block-compile" bash benchmarks/gpu_fp8_table.sh
  fi
done
rm -f "$OUT"/prof/*.json.gz
