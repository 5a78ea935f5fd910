"""Debug: delayed scaling on one GPU, standalone Float8Linear, fp32 and bf16 models."""
import os
import torch
import torch.nn as nn
from fsdp8.fp8.convert import convert_to_fp8
from fsdp8.fp8.recipes import DelayedScaling

for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).cuda().to(dtype)
    convert_to_fp8(model, DelayedScaling(amax_history_len=4))
    for step in range(4):
        x = torch.randn(16, 32, device="cuda", dtype=dtype, requires_grad=True)
        out = model(x)
        out.float().pow(2).mean().backward()
        s = model[0]._delayed
        print(os.environ.get("FSDP8_TRITON", "1"), dtype, step, "out finite", torch.isfinite(out).all().item(),
              "dx", torch.isfinite(x.grad).all().item(), "dw", torch.isfinite(model[0].weight.grad).all().item(),
              "pending", s.pending.tolist(), "scale", s.scale.tolist(), flush=True)
        model.zero_grad()
