"""The fused SwiGLU backward's kernels on the GPU (fsdp8/fp8/swiglu.py) against the op-by-op code."""

import copy

import pytest
import torch

from fsdp8.fp8 import triton_kernels
from fsdp8.fp8.formats import E4M3, E5M2, FP8_MAX, Granularity
from fsdp8.fp8.kernels import expand_scale
from fsdp8.fp8 import swiglu
from fsdp8.fp8.swiglu import SwiGLUGrads, swiglu_backward, swiglu_backward_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and triton_kernels.available()), reason="needs CUDA and Triton"),
]


def _inputs(shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = torch.randn(shape, generator=gen, device="cuda") * 3
    u = torch.randn(shape, generator=gen, device="cuda")
    dh = torch.randn(shape, generator=gen, device="cuda") * torch.logspace(-4, 2, shape[1], device="cuda")
    dh[5, 7], dh[130, 200], dh[1, 129] = float("nan"), float("inf"), -float("inf")
    dh[128:256, :128] = 0.0  # zero blocks in dg and du
    g[0, :128] = -200.0  # silu(g) underflows to -0: h's and du's blocks there are zero
    return dh.to(dtype), g.to(dtype), u.to(dtype)


def _check(got, want, exact):
    """Equal bytes and scales; without ``exact`` (Triton's approximate exp and division) a
    value may be one ulp of the input dtype off, moving at most its own byte by one FP8 step
    or its block's scale by an ulp: 1e-4 of the bytes, scales within two bf16 ulps (8e-3), values
    within one FP8 step of their block's amax (FP8_MAX * scale_inv; a step is 1/8 of a value at
    most in e4m3, 1/4 in e5m2)."""
    for name, a, b in zip(got._fields, got, want):
        assert a.data.shape == b.data.shape and a.scale_inv.shape == b.scale_inv.shape, name
        same = a.data.view(torch.uint8) == b.data.view(torch.uint8)
        nan_a, nan_b = a.scale_inv.isnan(), b.scale_inv.isnan()
        assert torch.equal(nan_a, nan_b), name
        if exact:
            assert bool(same.all()), (name, int((~same).sum()))
            assert torch.equal(a.scale_inv.nan_to_num(), b.scale_inv.nan_to_num()), name
            continue
        assert (~same).float().mean() <= 1e-4, (name, int((~same).sum()))
        torch.testing.assert_close(a.scale_inv.nan_to_num(), b.scale_inv.nan_to_num(), rtol=8e-3, atol=0)
        da, db = a.dequantize(torch.float32), b.dequantize(torch.float32)
        finite = da.isfinite() & db.isfinite()
        step = 0.25 if a.fp8_dtype == E5M2 else 0.125
        block_amax = FP8_MAX[b.fp8_dtype] * expand_scale(b.scale_inv.nan_to_num(), Granularity.ROW_1x128, db.shape)
        assert bool(((da - db).abs() <= step * block_amax)[finite].all()), name


SHAPES = [(256, 384), (1024, 2048), (4096, 1408)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_fp8", [E4M3, E5M2])
def test_two_passes_with_torchs_maths_give_eagers_bytes(shape, dtype, grad_fp8):
    """With torch's formulas (EXACT) the kernels make the op-by-op code's bytes: every
    layout, scale and block of the two passes is checked without the maths' noise."""
    dh, g, u = _inputs(shape, dtype, seed=shape[1])
    # Defined only where Triton is (the module skips itself elsewhere): read them at run time.
    outs = swiglu.swiglu_backward_outputs(dh, grad_fp8, E4M3)
    swiglu.two_passes(dh, g, u, outs, grad_fp8 == E5M2, False, exact=True)
    _check(SwiGLUGrads.from_outputs(outs), swiglu_backward_reference(dh, g, u, grad_fp8, E4M3), exact=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_backward_within_an_ulp_of_eager(shape, dtype):
    """What fsdp8 runs (the graph op, approximate maths), eager and inside a compiled graph."""
    dh, g, u = _inputs(shape, dtype, seed=7)
    want = swiglu_backward_reference(dh, g, u, E4M3, E4M3)
    _check(swiglu_backward(dh, g, u, E4M3, E4M3), want, exact=False)
    flat = torch.compile(lambda dh, g, u: [t for q in swiglu_backward(dh, g, u, E4M3, E4M3)
                                           for t in (q.data, q.scale_inv)], fullgraph=True)
    _check(SwiGLUGrads.from_outputs(flat(dh, g, u)), want, exact=False)


def test_fused_mlp_on_the_gpu_matches_its_three_linears():
    """A Llama MLP under block scaling with native GEMMs. Eager, the fused function against the
    three linears: the kernels' values are those of eager's ops but for a rare ulp (above), so
    nearly every FP8 byte is equal and the results agree to 1e-3 of each tensor's largest
    entry. Compiled, both differ from eager (Inductor skips the roundings between the three
    linears' fused ops, moving ~3% of their FP8 bytes; the fused kernel keeps them): the fused
    graph is to be no further from the eager linears than the linears' own graph."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.fp8.recipes import Float8BlockScaling

    torch.manual_seed(0)
    plain = LlamaMLP(transformers.LlamaConfig(hidden_size=512, intermediate_size=1024)).cuda().bfloat16()
    fused = copy.deepcopy(plain)
    convert_to_fp8(plain, Float8BlockScaling())
    plain.__class__ = LlamaMLP
    convert_to_fp8(fused, Float8BlockScaling())
    assert type(fused).__name__ == "Float8SwiGLULlamaMLP"
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x) * 1e-2

    def run(module, compiled):
        xi = x.clone().requires_grad_()
        y = (torch.compile(module) if compiled else module)(xi)
        y.backward(dy)
        out = [y.detach().float(), xi.grad.float()] + [p.grad.float() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return out

    eager, eager_fused = run(plain, False), run(fused, False)
    compiled, compiled_fused = run(plain, True), run(fused, True)
    for want, a, b, c in zip(eager, eager_fused, compiled, compiled_fused):
        top = want.abs().amax().item()
        assert (a - want).abs().amax().item() <= 1e-3 * top
        assert (c - want).abs().amax().item() <= 1.25 * (b - want).abs().amax().item() + 1e-3 * top
