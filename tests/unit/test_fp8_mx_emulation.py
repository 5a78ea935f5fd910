"""MX linears where the device has no MX tensor cores (fsdp8/fp8/mx_emulation.py): each operand's
MX values in one pass, read through transposed views. They must be the values of quantizing
to FP8 and dequantizing, bit for bit, so a compiled MX linear (which takes this path) computes
what an eager one does."""

import pytest
import torch

from fsdp8.fp8 import mx_emulation
from fsdp8.fp8.convert import convert_to_fp8
from fsdp8.fp8.formats import E4M3, E5M2, Granularity
from fsdp8.fp8.kernels import quantize, quantize_reference
from fsdp8.fp8.linear import _Float8LinearFn
from fsdp8.fp8.recipes import recipe_from_name
from fsdp8.fp8.tensor import Float8Tensor


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[1])
    x[0, :32] = 0.0  # an all-zero block
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(64, 96), (37, 70)])
@pytest.mark.parametrize("dtype,out", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.float64, torch.float64)])
def test_mx_round_is_quantize_then_dequantize_bit_for_bit(fp8, shape, dtype, out):
    x = _inputs(shape, dtype)
    rows = quantize(x, fp8, Granularity.MX_1x32).dequantize(out)
    cols = quantize(x.t().contiguous(), fp8, Granularity.MX_1x32).dequantize(out).t()
    for got, want in ((mx_emulation.mx_round(x, True, fp8, out), rows),
                      (mx_emulation.mx_round(x, False, fp8, out), cols)):
        assert got.shape == x.shape and got.dtype == out
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def _engine_weight(weight):
    """The weight as the engine hands it to a linear: MX bytes and scales (a Float8Tensor)."""
    q = quantize_reference(weight.detach(), E4M3, Granularity.MX_1x32)
    return Float8Tensor(q.data, q.scale_inv, Granularity.MX_1x32, weight.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dims", [(96, 64, 40), (80, 48, 17)])  # in, out, tokens per sequence (ragged blocks)
@pytest.mark.parametrize("engine_weight", [False, True])
def test_emulated_linear_equals_the_fp8_linear_bit_for_bit(dtype, dims, engine_weight):
    """Output, input, weight and bias gradients against the FP8 linear's (FP8 operands,
    dequantized in the GEMM), eagerly on the CPU, the same bytes."""
    k, n, tokens = dims
    recipe = recipe_from_name("fp8-mxfp8")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, tokens, k, generator=g, dtype=dtype) * 3
    x[0, 0, 5] = 100.0
    dy = torch.randn(3, tokens, n, generator=g, dtype=dtype)
    weight, bias = torch.randn(n, k, generator=g, dtype=dtype) / k**0.5, torch.randn(n, generator=g, dtype=dtype)
    results = []
    for path in (_Float8LinearFn.apply, mx_emulation.mx_emulated_linear):
        xi = x.clone().requires_grad_(True)
        w = (_engine_weight(weight) if engine_weight else weight.clone()).requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        out = path(xi, w, b, recipe) if path is mx_emulation.mx_emulated_linear else path(xi, w, b, recipe, None)
        out.backward(dy)
        results.append((out, xi.grad, w.grad, b.grad))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


def test_compiled_mx_linear_takes_the_emulated_path(monkeypatch):
    """Under torch.compile on a device without MX tensor cores (this CPU), a Float8Linear with
    MX scaling runs mx_emulated_linear (test_fp8.py compares its results with eager's)."""
    calls = []
    original = mx_emulation.mx_emulated_linear

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(mx_emulation, "mx_emulated_linear", counted)
    torch.manual_seed(0)
    model = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)),
                           recipe_from_name("fp8-mxfp8"))
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True)(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert len(calls) == 2
    assert not mx_emulation.emulated(recipe_from_name("fp8-current"), torch.device("cpu"))


def test_mx_round_rejects_other_shapes():
    with pytest.raises(ValueError, match="2-D"):
        mx_emulation.mx_round(torch.zeros(2, 3, 32), True, E4M3, torch.float32)

