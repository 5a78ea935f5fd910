# Sourced by the GPU scripts: the NCCL settings the lent machines need, $OUT, the carried
# wheels (.whl/, or $WHEELS) and the checkout on PYTHONPATH, and record_env for env.txt.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ${WHEELS:-.whl/*.whl} && export PYTHONPATH=/tmp/site
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
record_env() {  # GPUs and package versions -> $OUT/env.txt
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "
import importlib, torch
versions = {name: getattr(importlib.util.find_spec(name) and importlib.import_module(name), '__version__', 'absent')
            for name in ('triton', 'transformers', 'torchao')}
print('torch', torch.__version__, *(f'{k} {v}' for k, v in versions.items()))"
  } 2>&1 | tee "$OUT/env.txt"
}
