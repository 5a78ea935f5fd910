#!/usr/bin/env bash
# One device-machine call (2x H200) for the FP8 issue: kernel and engine tests over NCCL,
# the GEMM table, fsdp8 train in FP8, and the peer benchmark with FP8 stacks.
set -uo pipefail
source benchmarks/gpu_env.sh
record_env
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py -x 2>&1 | tee "$OUT/kernels.log" | tail -n 15
  FSDP8_TEST_BACKEND=nccl timeout 200 python3 -m pytest -q -p no:cacheprovider tests/dist/test_fp8_engine.py tests/gpu/test_cuda.py \
    2>&1 | tee "$OUT/tests.log" | tail -n 12
fi
timeout 120 python3 benchmarks/fp8_gemm.py --out "$OUT/gemm.json" 2>&1 | tail -n 24
timeout 120 python3 -m fsdp8 train --precision fp8-current --preset small --steps 60 --batch-size 16 --seq-len 1024 --out "$OUT/train" 2>&1 | tail -n 4
timeout "${BENCH_TIMEOUT:-300}" torchrun --nproc_per_node 2 benchmarks/peers.py --models "${MODELS:-B}" \
  --stacks "${STACKS:-fsdp8-fp8-current,fsdp8-fp8-block,fsdp8-fp8-current-compile,fsdp8-fp8-block-compile,fsdp8-compile,torchao-compile}" \
  --out "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log" | grep -E "^\||^\[peers\]|FAILED|Error" | tail -n 30
