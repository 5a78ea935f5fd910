"""Model A's block-scaled GEMMs (1x128 activations and gradients, 128x128 weights) through
cuBLAS in both operand orders: ``a @ b.T`` as fsdp8 calls it, and ``(b @ a.T).T``, which
makes cuBLAS run another kernel for the same product. Per-tensor-scaled GEMMs of the same
shapes beside them. Prints microseconds (triton.testing.do_bench, median) and, for the
swapped order, the largest difference from the first order relative to the output's largest
magnitude (both are bf16 outputs of fp32 sums in different orders).

    python benchmarks/debug/block_gemm_orders.py [--tokens 8192]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8.formats import E4M3, Granularity  # noqa: E402
from fsdp8.fp8.kernels import quantize  # noqa: E402
from fsdp8.fp8.gemm import _outer_major, fp8_mm  # noqa: E402
from fsdp8.fp8.recipes import Float8BlockScaling, Float8CurrentScaling  # noqa: E402

LINEARS = {"q/o": (2048, 2048), "k/v": (1024, 2048), "gate/up": (8192, 2048), "down": (2048, 8192)}


def block_scales(q, as_a: bool):
    """The scale tensor cuBLAS reads for one operand: 1x128 scales outer-dimension-major; a
    128x128 grid as fp8_mm lays it out for the second operand, or transposed for the first."""
    if q.granularity is Granularity.ROW_1x128:
        return _outer_major(q.scale_inv) if as_a else q.scale_inv.t().contiguous()
    return _outer_major(q.scale_inv) if as_a else _outer_major(q.scale_inv.t())


def raw_mm(a, b):
    """a @ b.T through torch._scaled_mm for any pair of block granularities."""
    return torch._scaled_mm(a.data, b.data.t(), block_scales(a, True), block_scales(b, False),
                            out_dtype=torch.bfloat16)


def main():
    from triton.testing import do_bench

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args()
    torch.manual_seed(0)
    t = args.tokens
    block, current = Float8BlockScaling(), Float8CurrentScaling()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, tokens {t}")
    print("| linear (N x K) | GEMM | block, fsdp8's order us | block, swapped us | swapped / fsdp8 | max diff | "
          "per-tensor us |")
    print("|---|---|---:|---:|---:|---:|---:|")
    totals = [0.0, 0.0, 0.0]
    for name, (n, k) in LINEARS.items():
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 0.01
        row, grid = Granularity.ROW_1x128, Granularity.BLOCK_128x128
        pairs = {  # (a, b) for a @ b.T, block-scaled, and the per-tensor pair
            "forward": ((quantize(x, E4M3, row), quantize(w, E4M3, grid)),
                        (quantize(x, E4M3, Granularity.TENSOR), quantize(w, E4M3, Granularity.TENSOR))),
            "input grad": ((quantize(dy, E4M3, row), quantize(w.t().contiguous(), E4M3, grid)),
                           (quantize(dy, E4M3, Granularity.TENSOR),
                            quantize(w.t().contiguous(), E4M3, Granularity.TENSOR))),
            "weight grad": ((quantize(dy.t().contiguous(), E4M3, row), quantize(x.t().contiguous(), E4M3, row)),
                            (quantize(dy.t().contiguous(), E4M3, Granularity.TENSOR),
                             quantize(x.t().contiguous(), E4M3, Granularity.TENSOR))),
        }
        for gemm, ((a, b), (ta, tb)) in pairs.items():
            ours = fp8_mm(a, b, torch.bfloat16, block)
            us = do_bench(lambda: fp8_mm(a, b, torch.bfloat16, block)) * 1e3
            tensorwise = do_bench(lambda: fp8_mm(ta, tb, torch.bfloat16, current)) * 1e3
            try:
                swapped = raw_mm(b, a).t()
                diff = ((swapped.float() - ours.float()).abs().max() / ours.float().abs().max()).item()
                swapped_us = do_bench(lambda: raw_mm(b, a)) * 1e3
                cells = f"{swapped_us:.0f} | {swapped_us / us:.3f} | {diff:.1e}"
                totals[1] += min(us, swapped_us)
            except RuntimeError as exc:  # an order cuBLAS or torch does not take
                cells = f"- | - | {str(exc).splitlines()[0][:60]}"
                totals[1] += us
            totals[0] += us
            totals[2] += tensorwise
            print(f"| {name} ({n} x {k}) | {gemm} | {us:.0f} | {cells} | {tensorwise:.0f} |", flush=True)
    print(f"\nsum over the table: block {totals[0]:.0f} us, block with the faster order of each {totals[1]:.0f}, "
          f"per-tensor {totals[2]:.0f}")


if __name__ == "__main__":
    main()
