"""Experiment: fsdp8's fused SwiGLU backward (fsdp8/fp8/swiglu.py) and the other
forms tried (swiglu_backward_kernel.py) against the op-by-op code compiled as the model
compiles it.

For model A's and B's MLP gradients, prints a table: milliseconds (CUDA-graph timed, the
kernels' own time), bytes moved per second, and how many FP8 bytes of each output differ
from the eager op-by-op code (``swiglu_backward_reference``); where bytes differ, the largest
difference of the dequantized values, relative to the tensor's largest value.

    PYTHONPATH=$PWD python benchmarks/debug/swiglu_backward_kernels.py [--dtypes bfloat16]
        [--variants two_passes,two_passes_exact,...]   # VARIANTS' names
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402

from fsdp8.fp8.swiglu import swiglu_backward  # noqa: E402
from fsdp8.fp8.triton_kernels import saturating_cast  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from both_ways_kernels import timed  # noqa: E402
import swiglu_backward_kernel as swiglu  # noqa: E402

E4 = torch.float8_e4m3fn


def _two_passes(**options):
    def run(dh, g, u):
        outs = swiglu.swiglu_backward_outputs(dh, E4, E4)
        swiglu.two_passes(dh, g, u, outs, False, False, **options)
        return swiglu.SwiGLUGrads.from_outputs(outs)
    return run


def _one_launch(kernel, grid, **options):
    def run(dh, g, u):
        m, n = dh.shape
        outs = swiglu.swiglu_backward_outputs(dh, E4, E4)
        kernel[grid(m, n)](dh, g, u, *outs, m, n, GRAD_E5M2=False, FWD_E5M2=False,
                           SATURATE=saturating_cast(dh.device), **options)
        return swiglu.SwiGLUGrads.from_outputs(outs)
    return run


def _three_programs(**options):
    return _one_launch(swiglu._swiglu_backward_kernel, lambda m, n: (3, (m // 128) * (n // 128)), **options)


VARIANTS = {
    "fsdp8": lambda dh, g, u: swiglu_backward(dh, g, u, E4, E4),  # the graph op fsdp8 runs
    "two_passes": _two_passes(),  # the same kernels, launched here
    "two_passes_exact": _two_passes(exact=True),
    "two_passes_rows_32_32": _two_passes(amax_rows=32, cast_rows=32),
    "two_passes_rows_16_16": _two_passes(amax_rows=16, cast_rows=16),
    "amax_8r_4w": _two_passes(amax_rows=8),
    "amax_16r_8w": _two_passes(amax_warps=8),
    "amax_32r_8w": _two_passes(amax_rows=32, amax_warps=8),
    "cast_32r_4w": _two_passes(cast_warps=4),
    "cast_64r_8w": _two_passes(cast_rows=64, cast_warps=8),
    "cast_16r_4w": _two_passes(cast_rows=16),
    "cast_16r_2w": _two_passes(cast_rows=16, cast_warps=2),
    "three_programs_8w_128r": _three_programs(num_warps=8, maxnreg=128),
    "three_programs_8w_128r_exact": _three_programs(num_warps=8, maxnreg=128, EXACT=True),
    "three_programs_16w": _three_programs(num_warps=16),
    "reread_32r_4w": _one_launch(swiglu._swiglu_reread_kernel, lambda m, n: (m // 128, n // 128), R=32, num_warps=4),
}


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
    p.add_argument("--variants", default="fsdp8,two_passes_exact,three_programs_8w_128r")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| tokens x ffn | dtype | code | ms | GB/s | against eager op by op |")
    print("|---|---|---|---:|---:|---|")
    flat = torch.compile(lambda dh, g, u: [t for q in swiglu.swiglu_backward_reference(dh, g, u, E4, E4)
                                           for t in (q.data, q.scale_inv)], fullgraph=True)

    def compiled(dh, g, u):
        return swiglu.SwiGLUGrads.from_outputs(flat(dh, g, u))
    for (m, n) in [(8192, 8192), (4096, 14336), (1024, 1024)]:
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            g = torch.randn(m, n, device="cuda", dtype=dtype) * 2
            u = torch.randn(m, n, device="cuda", dtype=dtype)
            dh = torch.randn(m, n, device="cuda", dtype=dtype) * torch.rand(n, device="cuda", dtype=dtype) * 1e-3
            ref = swiglu.swiglu_backward_reference(dh, g, u, E4, E4)
            moved = 3 * dh.numel() * dh.element_size() + 5 * dh.numel()
            runs = [("op by op, compiled", lambda: compiled(dh, g, u))]
            runs += [(name, (lambda f=VARIANTS[name]: f(dh, g, u))) for name in args.variants.split(",")]
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
