"""ncu target (issue 17): fsdp8's 1x128 both-ways quantization of an 8192x8192 bf16 gradient,
launched three times; profile the last:

    ncu --kernel-name regex:rows_and_cols --launch-skip 2 --launch-count 1 \
        python3 benchmarks/debug/ncu_both_ways.py
"""

import torch
from fsdp8.fp8.triton_kernels import quantize_1x128_both_ways
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    quantize_1x128_both_ways(x, torch.float8_e4m3fn)
torch.cuda.synchronize()
