"""Experiment (issue 17): SwiGLU's backward with the block recipe's quantizations fused in
(swiglu_backward_kernel.py) against the op-by-op code compiled as the model compiles it.

For model A's and B's MLP gradients, prints a table: milliseconds (CUDA-graph timed, the
kernels' own time), bytes moved per second, and how many FP8 bytes of each output differ
from the eager op-by-op code (``swiglu_backward_reference``); where bytes differ, the largest
difference of the dequantized values, relative to the block's largest value.

    PYTHONPATH=$PWD python benchmarks/debug/swiglu_backward_kernels.py [--dtypes bfloat16]
        [--warps 8:128f,p32x4,p32x4f]   # see fused_with_warps for the variants' names
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402

from fsdp8.fp8.triton_kernels import saturating_cast  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from both_ways_kernels import timed  # noqa: E402
import swiglu_backward_kernel as swiglu  # noqa: E402


def fused_with_warps(variant):
    """A variant by name. Three programs a tile: '<warps>' or '<warps>:<maxnreg>' (a register
    cap, so more programs share an SM). The two passes: 'p<rows>x<warps>'; both in one program,
    the second reading from L2: 'r<rows>x<warps>'. A trailing 'f': FAST=1
    maths; 'ff': FAST=2 (two passes only)."""
    if variant[0] in "pr":
        rows, _, warps = variant[1:].rstrip("f").partition("x")

        def two(dh, g, u):
            outs = _outputs(dh)
            fast = 2 if variant.endswith("ff") else int(variant.endswith("f"))
            swiglu.two_pass(dh, g, u, outs, False, False, int(rows), int(warps), fast, reread=variant[0] == "r")
            return _grads(outs)
        return two
    fast = variant.endswith("f")
    warps, _, cap = variant.rstrip("f").partition(":")
    options = {"num_warps": int(warps), "FAST": fast, **({"maxnreg": int(cap)} if cap else {})}

    def run(dh, g, u):
        m, n = dh.shape
        outs = _outputs(dh)
        swiglu._swiglu_backward_kernel[(3, (m // 128) * (n // 128))](
            dh, g, u, *outs, m, n, GRAD_E5M2=False, FWD_E5M2=False, SATURATE=saturating_cast(dh.device), **options)
        return _grads(outs)
    return run


def _outputs(dh):
    m, n = dh.shape
    e4 = torch.float8_e4m3fn

    def pair(rows, cols):
        return [torch.empty((rows, cols), dtype=e4, device="cuda"), torch.empty((rows, cols // 128), device="cuda")]

    return pair(m, n) + pair(n, m) + pair(m, n) + pair(n, m) + pair(n, m)


def _grads(outs):
    return swiglu.SwiGLUGrads(*(swiglu.Quantized(outs[i], outs[i + 1], swiglu.Granularity.ROW_1x128)
                                for i in range(0, 10, 2)))


def differences(ref, got):
    """'name: bytes differing (largest dequantized difference / block amax)' per output."""
    notes = []
    for name, r, q in zip(swiglu.SwiGLUGrads._fields, ref, got):
        diff = (r.data.view(torch.uint8) != q.data.view(torch.uint8)).sum().item()
        scales_equal = torch.equal(r.scale_inv, q.scale_inv)
        if diff or not scales_equal:
            a, b = r.dequantize(torch.float32), q.dequantize(torch.float32)
            top = a.abs().amax().clamp(min=1e-30)
            notes.append(f"{name}: {diff} B, scales {'=' if scales_equal else '!='}, max |d| {((a - b).abs().amax() / top).item():.1e}")
    return "; ".join(notes) or "all equal"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--warps", default="8:128,8:128f,p32x4,p32x4f,p32x8f,p64x8f")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| tokens x ffn | dtype | code | ms | GB/s | against eager op by op |")
    print("|---|---|---|---:|---:|---|")
    e4 = torch.float8_e4m3fn
    flat = torch.compile(lambda dh, g, u: [t for q in swiglu.swiglu_backward_reference(dh, g, u, e4, e4)
                                           for t in (q.data, q.scale_inv)], fullgraph=True)

    def compiled(dh, g, u):
        t = flat(dh, g, u)
        return swiglu.SwiGLUGrads(*(swiglu.Quantized(t[i], t[i + 1], swiglu.Granularity.ROW_1x128)
                                    for i in range(0, 10, 2)))
    for (m, n) in [(8192, 8192), (4096, 14336), (1024, 1024)]:
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            g = torch.randn(m, n, device="cuda", dtype=dtype) * 2
            u = torch.randn(m, n, device="cuda", dtype=dtype)
            dh = torch.randn(m, n, device="cuda", dtype=dtype) * torch.rand(n, device="cuda", dtype=dtype) * 1e-3
            ref = swiglu.swiglu_backward_reference(dh, g, u, e4, e4)
            moved = 3 * dh.numel() * dh.element_size() + 5 * dh.numel()
            runs = [("op by op, compiled", lambda: compiled(dh, g, u))]
            runs += [(f"fused {w}", (lambda f=fused_with_warps(w): f(dh, g, u)))
                     for w in args.warps.split(",")]
            for name, fn in runs:
                try:
                    got = fn()
                    ms = timed(fn, args.iters, graph=True)
                    verdict = differences(ref, got)
                except Exception as err:  # a variant that does not compile or launch: say so, go on
                    print(f"| {m} x {n} | {str(dtype)[6:]} | {name} | - | - | {type(err).__name__}: {err} |")
                    continue
                print(f"| {m} x {n} | {str(dtype)[6:]} | {name} | {ms:.4f} | {moved / ms / 1e6:.0f} | {verdict} |",
                      flush=True)


if __name__ == "__main__":
    main()
