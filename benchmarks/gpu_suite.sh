#!/usr/bin/env bash
# The distributed and GPU tests over NCCL on every GPU of this machine, in one device call:
# pytest-xdist spreads the tests over XDIST sessions side by side (each with its own pools of
# 1, 2 and 4 ranks), so the suite fits the call limit; a hung test is stopped by the
# harness, which dumps every rank's Python stacks into the failure. Logs and a JUnit file
# (per-test times) land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/env.txt"
start=$(date +%s)
FSDP8_TEST_BACKEND=nccl FSDP8_TEST_LOG="$OUT/outcomes.log" FSDP8_TEST_TIMEOUT=${TEST_TIMEOUT:-150} timeout "${SUITE_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider \
  -n "${XDIST:-12}" --dist "${DIST:-load}" -rfE --durations=25 --junitxml="$OUT/junit.xml" ${TESTS:-tests/dist tests/gpu} \
  > "$OUT/tests.log" 2>&1
status=$?
echo "exit $status after $(( $(date +%s) - start )) s" | tee -a "$OUT/tests.log"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 3
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
