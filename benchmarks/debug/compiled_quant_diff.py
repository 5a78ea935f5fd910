"""Debug: FP8 quantization compiled by Inductor against the eager Triton kernels, byte for
byte, per granularity (one GPU). Prints how many FP8 bytes and scales differ.

    python benchmarks/debug/compiled_quant_diff.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8.formats import E4M3, E5M2, Granularity  # noqa: E402
from fsdp8.fp8.kernels import cast_transpose, quantize_1x128_both_ways, quantize  # noqa: E402


def both_ways(x, fp8):
    q, qt = quantize_1x128_both_ways(x, fp8)
    return q.data, q.scale_inv, qt.data, qt.scale_inv


def tensorwise(x, fp8):
    q, qt, amax, inv = cast_transpose(x, fp8)
    return q, inv, qt, inv


def blocks(x, fp8):
    q = quantize(x, fp8, Granularity.BLOCK_128x128)
    return q.data, q.scale_inv, q.data, q.scale_inv


def compare(name, fn, x, fp8):
    eager = fn(x, fp8)
    compiled = torch.compile(fn, fullgraph=True)(x, fp8)
    parts = ("q", "scale_inv", "q_t", "scale_inv_t")
    report = []
    for part, a, b in zip(parts, eager, compiled):
        if a.dtype in (E4M3, E5M2):
            diff = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
        else:
            diff = (a != b).sum().item()
        report.append(f"{part}: {diff}/{a.numel()} differ")
    print(f"{name:10s} {str(fp8):22s} " + ", ".join(report), flush=True)


torch.manual_seed(0)
x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 3
for fp8 in (E4M3, E5M2):
    compare("tensor", tensorwise, x, fp8)
    compare("1x128", both_ways, x, fp8)
    compare("128x128", blocks, x, fp8)
