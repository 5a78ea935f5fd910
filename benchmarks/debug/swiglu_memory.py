"""Experiment: memory of block scaling's fused SwiGLU MLP (fsdp8/fp8/mlp.py) against
its three linears, compiled, on a stack of residual MLP blocks of model A's or B's shapes.

Prints, per form: memory held after the forward (what the backward keeps), the forward's and
the backward's peaks above the inputs, in MiB (torch.cuda.max_memory_allocated). It found the
fused function's first form keeping its activations (ctx attributes) until the whole backward
was done: +52 MiB over the linears with one block of model B, +499 MiB with three; the order
of its backward's GEMMs changed nothing. Saved through save_for_backward: equal peaks.

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
    for name, blocks in (("three linears", plain), ("fused", fused)):
        compiled = [torch.compile(block) for block in blocks]
        measure(compiled, x)  # compile and warm
        held, fwd, bwd = measure(compiled, x)
        print(f"| {name} | {type(blocks[0].mlp).__name__} | {held:.0f} | {fwd:.0f} | {bwd:.0f} |", flush=True)


if __name__ == "__main__":
    main()
