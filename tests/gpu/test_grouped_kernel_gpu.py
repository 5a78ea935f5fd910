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


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_group_quantization_is_the_torch_reference_bit_for_bit(fp8, monkeypatch):
    """quantize_groups' three launches (row maxima, every scale, the cast into both layouts), its cast
    with given scales, and the buffer's columns (one launch) against the torch ops of the CPU path,
    byte for byte."""
    from fsdp8.fp8 import triton_grouped

    assert triton_grouped.runs_on(torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    g = torch.Generator(device="cuda").manual_seed(1)
    sizes = [0, 130, 1, 0, 77, 300, 2500, 0]  # empty groups, one longer than a scale block of rows
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = (torch.randn(sum(sizes), 200, device="cuda", generator=g) * torch.logspace(-3, 3, 200, device="cuda")).bfloat16()
    x[5, 7], x[140, 3] = float("nan"), float("inf")  # a NaN and an infinity keep their groups' scales as torch makes them
    x[131:208] = x[131:208].sign() * 1e-37  # group 4's amax so small that its scale overflows: 1
    got = grouped_kernel.quantize_groups(x, fp8, grouped_kernel.Groups(offs), padded=True)
    cpu_groups = grouped_kernel.Groups(offs.cpu())
    want = grouped_kernel.quantize_groups(x.cpu(), fp8, cpu_groups, padded=True)
    for name in ("data", "padded_t"):
        assert torch.equal(getattr(got, name).cpu().view(torch.uint8), getattr(want, name).view(torch.uint8)), name
    for name in ("inv", "row_inv"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    gpu_groups = grouped_kernel.Groups(offs)
    assert torch.equal(gpu_groups.sources(sum(sizes)).cpu(), cpu_groups.sources(sum(sizes)))
    assert torch.equal(gpu_groups.padded_ends(sum(sizes)).cpu(), cpu_groups.padded_ends(sum(sizes)))
    unpadded = grouped_kernel.quantize_groups(x, fp8, grouped_kernel.Groups(offs))
    assert unpadded.padded_t is None and torch.equal(unpadded.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    scale = torch.logspace(-2, 2, len(sizes), device="cuda")  # given scales (delayed scaling's): the same cast
    given = grouped_kernel.quantize_groups(x, fp8, grouped_kernel.Groups(offs), padded=True, scale=scale)
    want = grouped_kernel.quantize_groups(x.cpu(), fp8, grouped_kernel.Groups(offs.cpu()), padded=True,
                                          scale=scale.cpu())
    for name in ("data", "padded_t"):
        assert torch.equal(getattr(given, name).cpu().view(torch.uint8), getattr(want, name).view(torch.uint8)), name
    for name in ("inv", "row_inv"):
        assert torch.equal(getattr(given, name).cpu(), getattr(want, name)), name
    w = torch.randn(5, 48, 96, device="cuda", generator=g).bfloat16()
    data, inv = grouped_kernel.quantize_experts(w, fp8)  # the kernel, each expert's rows one group
    want_data, want_inv = grouped_kernel.quantize_experts(w.cpu(), fp8)
    assert torch.equal(data.cpu().view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(inv.cpu(), want_inv)


@pytest.mark.parametrize("shape", [(3, 48, 96), (2, 130, 70), (1, 1536, 2048)])
def test_triton_transpose_bytes_is_torch_transpose(shape):
    """Tiles that straddle the edges (130 x 70 on 64 x 64 tiles) and a model-sized matrix."""
    from fsdp8.fp8 import triton_grouped

    g = torch.Generator(device="cuda").manual_seed(2)
    data = torch.randint(0, 256, shape, device="cuda", generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = triton_grouped.transpose_bytes(data)
    assert got.is_contiguous() and got.shape == (shape[0], shape[2], shape[1])
    assert torch.equal(got.view(torch.uint8), data.view(torch.uint8).transpose(1, 2))


def test_compiled_experts_trace_the_kernel_with_the_eager_results():
    """In one graph (fullgraph: no break at the experts), the same bytes as the eager call."""
    from fsdp8.fp8 import grouped_kernel
    from fsdp8.fp8.grouped import fp8_grouped_mm
    from fsdp8.fp8.recipes import Float8CurrentScaling

    assert grouped_kernel.kernel_runs(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(3)
    sizes = [0, 900, 1, 2047, 0, 17, 1100, 31]
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 2048, device="cuda", generator=g).bfloat16()
    w = torch.randn(len(sizes), 1536, 2048, device="cuda", generator=g).bfloat16() * 0.02
    dy = torch.randn(sum(sizes), 1536, device="cuda", generator=g).bfloat16()
    recipe = Float8CurrentScaling(fp8_format="e4m3")

    def step(x, w):
        return fp8_grouped_mm(x, w, offs, recipe)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xr, wr)
        results.append((out, *torch.autograd.grad(out, (xr, wr), dy)))
    for a, b in zip(*results):  # the same ops on the same bytes
        assert torch.equal(a, b)
