#!/usr/bin/env bash
# Debug call (4x H200): the two-hop HSDP gather by hand, the failing HSDP tests with and
# without CUDA_LAUNCH_BLOCKING, then the compiled-FP8 checks. Output in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
export PYTHONPATH="$PWD"
timeout 90 torchrun --nproc_per_node 4 benchmarks/debug/two_hop_nccl.py 2>&1 | grep -E "^rank|^split" | head -40
HSDP_TESTS="tests/dist/test_parity.py::test_hsdp_2x2_parity tests/dist/test_fp8_engine.py::test_fp8_hsdp_outer_optim_gather"
FSDP8_TEST_BACKEND=nccl FSDP8_TEST_WORLDS=1,4 timeout 150 python3 -m pytest -q -p no:cacheprovider $HSDP_TESTS 2>&1 | tee "$OUT/hsdp.log" | grep -E "passed|failed|^FAILED" | cut -c1-200
CUDA_LAUNCH_BLOCKING=1 FSDP8_TEST_BACKEND=nccl FSDP8_TEST_WORLDS=1,4 timeout 150 python3 -m pytest -q -p no:cacheprovider $HSDP_TESTS 2>&1 | tee "$OUT/hsdp_blocking.log" | grep -E "passed|failed|^FAILED" | cut -c1-200
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py -k compiled 2>&1 | tee "$OUT/gpu_compiled.log" | grep -E "passed|failed|^FAILED|^E  " | head -12 | cut -c1-250
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
CUDA_VISIBLE_DEVICES=0,1 timeout 240 torchrun --nproc_per_node 2 benchmarks/peers.py --models B --warmup 2 --steps 8 \
  --stacks "${STACKS:-fsdp8-fp8-current-compile,fsdp8-fp8-block-compile,torchao-compile}" --out "$OUT/peers2.json" \
  >"$OUT/peers2.log" 2>&1; grep -E "^\|" "$OUT/peers2.log" | cut -c1-240
