"""Experiment (issue 17): the host's cost of one GEMM call, bf16 `torch.mm` against FP8
`torch._scaled_mm` (tensorwise and 1x128/128x128 blockwise), on tiny shapes so the GPU never
holds the host back: microseconds of host time per call, median of 5 loops of 200 calls.

    PYTHONPATH=$PWD python benchmarks/debug/gemm_host_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch

E4 = torch.float8_e4m3fn


def host_us(fn, calls: int = 200, loops: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main():
    dev = "cuda"
    m = n = k = 256
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    a8, b8 = a.to(E4), b.to(E4)
    one = torch.ones((), device=dev)
    rows = [
        ("torch.mm bf16", lambda: torch.mm(a, b.t())),
        ("F.linear bf16", lambda: torch.nn.functional.linear(a, b)),
        ("_scaled_mm tensorwise", lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)),
    ]
    row_scale, col_scale = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
    rows.append(("_scaled_mm rowwise", lambda: torch._scaled_mm(a8, b8.t(), row_scale, col_scale,
                                                              out_dtype=torch.bfloat16)))
    sa = torch.ones(k // 128, m, device=dev).t()  # 1x128 blocks, M-major as cuBLAS wants
    sb = torch.ones(n // 128, k // 128, device=dev)  # 128x128 blocks
    rows.append(("_scaled_mm 1x128 x 128x128", lambda: torch._scaled_mm(a8, b8.t(), sa, sb.t(),
                                                                      out_dtype=torch.bfloat16)))
    rows.append(("empty (an allocation)", lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | host us per call |")
    print("|---|---:|")
    for name, fn in rows:
        try:
            print(f"| {name} | {host_us(fn):.1f} |", flush=True)
        except Exception as err:  # a scaling mode this torch does not take: say so, go on
            print(f"| {name} | {type(err).__name__}: {str(err)[:80]} |")


if __name__ == "__main__":
    main()
