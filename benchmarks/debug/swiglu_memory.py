"""Experiment (issue 17): memory of block scaling's fused SwiGLU MLP (fsdp8/fp8/mlp.py) against
its three linears, compiled, on a stack of residual MLP blocks of model A's or B's shapes.

Prints, per form: memory held after the forward (what the backward keeps), the forward's and
the backward's peaks above the inputs, in MiB (torch.cuda.max_memory_allocated).

    PYTHONPATH=$PWD python benchmarks/debug/swiglu_memory.py [--model B] [--layers 3]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8.convert import convert_to_fp8  # noqa: E402
from fsdp8.fp8.recipes import Float8BlockScaling  # noqa: E402

SHAPES = {"A": (2048, 8192, 8192), "B": (4096, 14336, 4096)}  # hidden, ffn, tokens


class Block(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        self.norm = LlamaRMSNorm(hidden)
        self.mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=ffn))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def measure(blocks, x):
    mib = 2**20
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    h = x.clone().requires_grad_()
    y = h
    for block in blocks:
        y = block(y)
    torch.cuda.synchronize()
    held, fwd_peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    y.backward(torch.ones_like(y) * 1e-3)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    del y, h
    for block in blocks:
        block.zero_grad(set_to_none=True)
    return held / mib, fwd_peak / mib, bwd_peak / mib


def _backward_weight_grads_first(ctx, dy):
    """_Float8SwiGLUFn.backward with the weight gradients before the input gradient, each FP8
    operand's last use as early as it can be."""
    from fsdp8.fp8.kernels import quantize_transposed
    from fsdp8.fp8.linear import _quantize_both_ways, _weight_transposed, fp8_mm
    from fsdp8.fp8.recipes import G
    from fsdp8.fp8.swiglu import swiglu_backward

    recipe, dtype = ctx.recipe, ctx.g.dtype
    (w_gate, w_up, w_down), (qw_gate, qw_up, qw_down) = ctx.weights, ctx.qws
    qdy, qdy_t = _quantize_both_ways(dy.reshape(-1, dy.shape[-1]).to(dtype), recipe.g_granularity,
                                     recipe.bwd_dtype, None, G)
    dh = fp8_mm(qdy, _weight_transposed(w_down, qw_down), dtype, recipe)
    grads = swiglu_backward(dh, ctx.g, ctx.u, recipe.bwd_dtype, recipe.fwd_dtype)
    dw_down = fp8_mm(qdy_t, grads.h_t, dtype, recipe).to(w_down.dtype)
    qx_t = ctx.qx_t
    if qx_t is None:
        qx_t = quantize_transposed(ctx.x.detach().reshape(-1, ctx.x_shape[-1]), recipe.fwd_dtype,
                                   recipe.x_granularity)
    dw_gate = fp8_mm(grads.dg_t, qx_t, dtype, recipe).to(w_gate.dtype)
    dw_up = fp8_mm(grads.du_t, qx_t, dtype, recipe).to(w_up.dtype)
    dx = fp8_mm(grads.dg, _weight_transposed(w_gate, qw_gate), dtype, recipe)
    dx = dx + fp8_mm(grads.du, _weight_transposed(w_up, qw_up), dtype, recipe)
    return dx.view(ctx.x_shape), dw_gate, dw_up, dw_down, None, None, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="B", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=3)
    args = p.parse_args()
    hidden, ffn, tokens = SHAPES[args.model]
    torch.manual_seed(0)
    base = nn.ModuleList(Block(hidden, ffn) for _ in range(args.layers)).cuda().bfloat16()
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    del base
    convert_to_fp8(plain, Float8BlockScaling())
    for block in plain:
        block.mlp.__class__ = type(block.mlp).__mro__[2]  # the three linears on their own
    convert_to_fp8(fused, Float8BlockScaling())
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    print(f"model {args.model} shapes, {args.layers} residual MLP blocks, compiled each; MiB")
    print("| form | class | held after forward | forward peak | backward peak |")
    print("|---|---|---:|---:|---:|")
    from fsdp8.fp8.mlp import _Float8SwiGLUFn

    forms = [("three linears", plain, None), ("fused", fused, None),
             ("fused, weight gradients first", copy.deepcopy(fused), _backward_weight_grads_first)]
    for name, blocks, backward in forms:
        if backward is not None:
            _Float8SwiGLUFn.backward = staticmethod(backward)
        compiled = [torch.compile(block) for block in blocks]
        measure(compiled, x)  # compile and warm
        held, fwd, bwd = measure(compiled, x)
        print(f"| {name} | {type(blocks[0].mlp).__name__} | {held:.0f} | {fwd:.0f} | {bwd:.0f} |", flush=True)


if __name__ == "__main__":
    main()
