#!/usr/bin/env bash
# One device-machine call (2x H200): environment, the distributed tests over NCCL, the
# GPU-only checks, then the peer benchmark. Results land in $OUT (default runs/gpu).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    ${WHEELS:-.whl/megatron_fsdp-*.whl} && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  FSDP8_TEST_BACKEND=nccl timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/dist tests/gpu \
    2>&1 | tee "$OUT/tests.log" | tail -n 25
fi
timeout "${BENCH_TIMEOUT:-420}" torchrun --nproc_per_node "${NPROC:-2}" benchmarks/peers.py \
  --models "${MODELS:-A,B}" --out "$OUT/peers.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/peers.log" | tail -n 40
