"""The grouped FP8 kernel on the GPU (fsdp8/fp8/grouped_kernel.py): torch._scaled_grouped_mm runs on
Hopper and gives the group-by-group torch._scaled_mm results on expert-sized problems."""

import pytest
import torch

from fsdp8.fp8 import grouped_kernel
from fsdp8.fp8.grouped import fp8_grouped_mm
from fsdp8.fp8.recipes import Float8CurrentScaling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper GPU (sm90)"),
]


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_grouped_kernel_runs_and_matches_group_by_group(fp8_format, monkeypatch):
    """Both ways see identical FP8 operands and differ in accumulation order (and the forward's
    fast accumulation) only, far below FP8 rounding: bound 1e-2 relative, as the dense GEMMs."""
    device = torch.device("cuda")
    assert grouped_kernel.kernel_runs(device)
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [0, 900, 1, 2047, 0, 17, 1100, 31]  # uneven, empty, none a multiple of 16 but one
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 2048, device=device, generator=g).bfloat16()
    w = torch.randn(len(sizes), 1536, 2048, device=device, generator=g).bfloat16() * 0.02
    dy = torch.randn(sum(sizes), 1536, device=device, generator=g).bfloat16()
    recipe = Float8CurrentScaling(fp8_format=fp8_format)
    results = []
    for one_kernel in (True, False):
        monkeypatch.setattr(grouped_kernel, "kernel_runs", lambda d, on=one_kernel: on)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fp8_grouped_mm(xr, wr, offs, recipe)
        results.append((out.float(), *(t.float() for t in torch.autograd.grad(out, (xr, wr), dy))))
    for a, b in zip(*results):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    assert (results[0][2][[0, 4]] == 0).all()  # empty groups: no weight gradient
