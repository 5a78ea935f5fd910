"""A SwiGLU MLP's three FP8 linears as one function under block scaling (fp8/mlp.py, fp8/swiglu.py):
the same bytes as the three linears on the CPU, and the cases it must leave alone."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp8.fp8.convert import convert_to_fp8
from fsdp8.fp8.formats import E4M3, E5M2, Granularity
from fsdp8.fp8.kernels import quantize_1x128_both_ways, quantize_transposed
from fsdp8.fp8.mlp import fuse_swiglu_mlps, fused_applies
from fsdp8.fp8.recipes import Float8BlockScaling, Float8CurrentScaling
from fsdp8.fp8.swiglu import swiglu_backward
from fsdp8.models.llama import FeedForward, LlamaConfig

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402


def _bytes(q):
    return q.data.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad_fp8", [E4M3, E5M2])
def test_swiglu_backward_is_autograds_backward_quantized(dtype, grad_fp8):
    """The fused backward's outputs are autograd's SwiGLU gradients and h, each quantized as
    the separate linears quantize them (NaN, infinite and zero blocks included)."""
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(256, 384, generator=gen) * 3).to(dtype).requires_grad_()
    u = torch.randn(256, 384, generator=gen).to(dtype).requires_grad_()
    dh = (torch.randn(256, 384, generator=gen) * torch.logspace(-3, 3, 384)).to(dtype)
    dh[5, 7], dh[130, 200], dh[0, 300] = float("nan"), float("inf"), -float("inf")
    dh[128:256, 0:128] = 0.0
    h = F.silu(g) * u
    h.backward(dh)
    got = swiglu_backward(dh, g.detach(), u.detach(), grad_fp8, E4M3)  # the reference code on the CPU
    dg, dg_t = quantize_1x128_both_ways(g.grad, grad_fp8)
    du, du_t = quantize_1x128_both_ways(u.grad, grad_fp8)
    h_t = quantize_transposed(h.detach(), E4M3, Granularity.ROW_1x128)
    for want, have in zip((dg, dg_t, du, du_t, h_t), got):
        assert torch.equal(_bytes(want), _bytes(have))
        assert torch.equal(want.scale_inv.isnan(), have.scale_inv.isnan())
        assert torch.equal(want.scale_inv.nan_to_num(), have.scale_inv.nan_to_num())
    # NaN, infinite and all-zero blocks were met (the latter two scaled by 1).
    assert got.dg.data.float().isnan().any() and (got.du_t.scale_inv == 1.0).any()


def _hf_mlp(bias=False, act="silu"):
    from transformers import LlamaConfig as HFConfig

    return LlamaMLP(HFConfig(hidden_size=128, intermediate_size=256, hidden_act=act, mlp_bias=bias))


def _pair(make, dtype, recipe, fuse=True):
    """(three Float8Linears, the same MLP converted with fusing) from one initialisation."""
    torch.manual_seed(0)
    plain = make().to(dtype)
    fused = copy.deepcopy(plain)
    base = type(plain)
    convert_to_fp8(plain, recipe)
    plain.__class__ = base  # the three linears on their own
    if fuse:
        convert_to_fp8(fused, recipe)
    return plain, fused


def _run(module, x, dy):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [y.detach(), x.grad] + grads


def _equal(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _fsdp8_mlp():
    return FeedForward(LlamaConfig(vocab_size=64, dim=128, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=256,
                                   max_seq_len=64))


MLPS = {"hf_llama": _hf_mlp, "fsdp8_llama": _fsdp8_mlp}


@pytest.mark.parametrize("mlp", sorted(MLPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [256, 100])  # 100: not whole 128-row tiles
def test_fused_mlp_equals_its_three_linears(mlp, dtype, tokens):
    plain, fused = _pair(MLPS[mlp], dtype, Float8BlockScaling())
    assert type(fused).__name__.startswith("Float8SwiGLU") and type(plain).__name__ in ("LlamaMLP", "FeedForward")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, tokens // 2, 128, generator=gen).to(dtype)
    dy = (torch.randn(2, tokens // 2, 128, generator=gen) * 1e-2).to(dtype)
    for want, got in zip(_run(plain, x, dy), _run(fused, x, dy)):
        assert _equal(want, got)


def test_fused_mlp_compiled_equals_three_linears_compiled():
    """Under torch.compile (Inductor's CPU code), the fused function traces into the same
    values as the three traced linears."""
    plain, fused = _pair(_hf_mlp, torch.bfloat16, Float8BlockScaling())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 128, 128, generator=gen).to(torch.bfloat16)
    dy = (torch.randn(2, 128, 128, generator=gen) * 1e-2).to(torch.bfloat16)
    want, got = _run(torch.compile(plain), x, dy), _run(torch.compile(fused), x, dy)
    for a, b in zip(want, got):
        assert _equal(a, b)
    eager = _run(fused, x, dy)  # the compiled graph ran (it differs from eager: no rounding between fused ops)
    assert not torch.equal(eager[1], got[1])


def test_fused_mlp_leaves_what_it_cannot_fuse():
    recipe = Float8BlockScaling()
    # Not under a recipe without 1x128 activations and gradients.
    plain, current = _pair(_hf_mlp, torch.float32, Float8CurrentScaling())
    assert type(current) is LlamaMLP and fuse_swiglu_mlps(current, Float8CurrentScaling()) == 0
    # Not an MLP of another form (GELU), nor with biases (its forward runs the three linears).
    gelu = convert_to_fp8(_hf_mlp(act="gelu"), recipe)
    assert type(gelu) is LlamaMLP
    plain, biased = _pair(lambda: _hf_mlp(bias=True), torch.float32, recipe)
    assert not fused_applies(biased.gate_proj, biased.up_proj, biased.down_proj)
    x, dy = torch.randn(1, 128, 128), torch.randn(1, 128, 128)
    assert all(_equal(a, b) for a, b in zip(_run(plain, x, dy), _run(biased, x, dy)))
    # A hook on one of the linears is honoured: the three linears run.
    plain, hooked = _pair(_hf_mlp, torch.float32, recipe)
    seen = []
    hooked.up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert not fused_applies(hooked.gate_proj, hooked.up_proj, hooked.down_proj)
    assert all(_equal(a, b) for a, b in zip(_run(plain, x, dy), _run(hooked, x, dy))) and seen == [(1, 128, 256)]


@pytest.mark.parametrize("family,cls", [("mistral", "MistralMLP"), ("qwen2", "Qwen2MLP"), ("qwen3", "Qwen3MLP")])
def test_copies_of_llamas_mlp_are_fused_too(family, cls):
    """The MLPs README names besides Llama's: recognised by their forward, fused, and equal to
    their three linears."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(transformers, f"{cls[:-3]}Config")(hidden_size=128, intermediate_size=256, hidden_act="silu")
    plain, fused = _pair(lambda: getattr(module, cls)(config), torch.float32, Float8BlockScaling())
    assert type(fused).__name__ == f"Float8SwiGLU{cls}"
    x, dy = torch.randn(1, 128, 128), torch.randn(1, 128, 128)
    assert all(_equal(a, b) for a, b in zip(_run(plain, x, dy), _run(fused, x, dy)))


def test_fusing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FSDP8_FUSE_SWIGLU", "0")
    assert type(convert_to_fp8(_hf_mlp(), Float8BlockScaling())) is LlamaMLP
    monkeypatch.setenv("FSDP8_FUSE_SWIGLU", "1")
    model = nn.Sequential(_hf_mlp(), _hf_mlp())
    convert_to_fp8(model, Float8BlockScaling())
    assert [type(m).__name__ for m in model] == ["Float8SwiGLULlamaMLP"] * 2
    assert fuse_swiglu_mlps(model, Float8BlockScaling()) == 0  # already marked
