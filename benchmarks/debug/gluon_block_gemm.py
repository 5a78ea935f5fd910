"""Experiment (issue 17): the Gluon block-scaled GEMM (gluon_block_kernel.py, beside this script)
against cuBLAS's blockwise and tensorwise FP8 GEMMs, at model A's and B's shapes, for each of
the three GEMMs of a linear (forward and input gradient: 1x128 by 128x128 scales; weight
gradient: 1x128 by 1x128, K = tokens).

    python benchmarks/debug/gluon_block_gemm.py [--tokens 8192] [--models A,B] [--configs ...] [--out f.json]
    python benchmarks/debug/gluon_block_gemm.py --ptxas   # no GPU needed: registers, spills, C75xx notes

Prints microseconds (triton.testing.do_bench median) and each kernel's largest error against
the exact product of the dequantized operands, in units of sum_k |a_k||b_k|.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_block_kernel import _block_scaled_mm_kernel, _block_scaled_mm_ws_kernel, block_scaled_mm  # noqa: E402

from fsdp8.fp8.formats import Granularity  # noqa: E402
from fsdp8.fp8.kernels import quantize  # noqa: E402
from fsdp8.fp8.gemm import fp8_mm  # noqa: E402
from fsdp8.fp8.recipes import Float8BlockScaling, Float8CurrentScaling  # noqa: E402

E4M3 = torch.float8_e4m3fn
CONFIGS = {  # name: (block_m, block_n, stages, warps, compact, unroll, warp-specialized, maxnreg, plain)
    "s64x128": (64, 128, 4, 4, True, 1, False, None, False),
    "u2-64x128": (64, 128, 4, 4, True, 2, False, None, False),
    "u4-64x128": (64, 128, 4, 4, True, 4, False, None, False),
    "u4-128x128w8": (128, 128, 4, 8, True, 4, False, None, False),
    "u2-128x128w8": (128, 128, 4, 8, True, 2, False, None, False),
    "ws64x128": (64, 128, 4, 4, True, 1, True, 128, False),
    "plain64x128": (64, 128, 4, 4, True, 1, False, None, True),
}


def shapes(tokens, models):
    dims = {"A": (2048, 8192, 1024), "B": (4096, 14336, 1024)}
    for model in models:
        h, ffn, kv = dims[model]
        for name, inp, out in (("qo", h, h), ("kv", h, kv), ("gate/up", h, ffn), ("down", ffn, h)):
            yield f"{model} {name} fwd", "fwd", tokens, out, inp
            yield f"{model} {name} dgrad", "fwd", tokens, inp, out
            yield f"{model} {name} wgrad", "wgrad", out, inp, tokens


def ptxas_report(configs):
    """Compile each config for sm_90a on this machine (Triton bundles ptxas) and print what
    ptxas says: registers, spills, and the C75xx notes on serialized wgmmas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(dtype, shape, gdtype):
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{gl.NVMMASharedLayout.get_default_for(shape, gdtype)!r}>"

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    for name in configs:
        bm, bn, stages, warps, compact, unroll, ws, maxnreg, plain = CONFIGS[name]
        for b_rows in (1, 128):
            sig = {"a_desc": desc("fp8e4nv", [bm, 128], gl.float8e4nv),
                   "b_desc": desc("fp8e4nv", [bn, 128], gl.float8e4nv), "c_desc": desc("bf16", [bm, bn], gl.bfloat16),
                   "sa_ptr": "*fp32", "sb_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "sa_stride_m": "i32",
                   "sa_stride_k": "i32", "sb_stride_n": "i32", "sb_stride_k": "i32"}
            consts = {"B_ROWS": b_rows, "STAGES": stages, "GROUP_M": 8, "COMPACT": compact and b_rows == 1,
                      "num_warps": warps}
            if not ws:
                consts.update(UNROLL=unroll, PLAIN=plain)
            sig.update({c: "constexpr" for c in consts})
            kernel = _block_scaled_mm_ws_kernel if ws else _block_scaled_mm_kernel
            options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
            compiled = triton.compile(GluonASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                                      options=options)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.ptx")
                with open(path, "w") as f:
                    f.write(compiled.asm["ptx"])
                out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".cubin"],
                                     capture_output=True, text=True).stderr
            notes = [line.split("info    : ")[-1] for line in out.splitlines()
                     if "Used" in line or "spill" in line or "(C75" in line]
            print(f"{name} b_rows={b_rows}: " + "; ".join(n.strip()[:120] for n in notes))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ptxas", action="store_true", help="compile for sm_90a here and print ptxas's report")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--models", default="A,B")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    configs = args.configs.split(",")
    if args.ptxas:
        return ptxas_report(configs)
    import triton.testing

    torch.manual_seed(0)
    cols = (["shape", "tensor", "tensor fast", "block cuBLAS"] + configs
            + ["best / cuBLAS", "best / tensor", "err cuBLAS"] + [f"err {c}" for c in configs])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
    results = []
    for name, kind, m, n, k in shapes(args.tokens, args.models.split(",")):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b_gran = Granularity.BLOCK_128x128 if kind == "fwd" else Granularity.ROW_1x128
        b_rows = 128 if kind == "fwd" else 1
        qa, qb = quantize(a, E4M3, Granularity.ROW_1x128), quantize(b, E4M3, b_gran)
        ta, tb = quantize(a, E4M3, Granularity.TENSOR), quantize(b, E4M3, Granularity.TENSOR)
        blk, cur = Float8BlockScaling(), Float8CurrentScaling()
        row = {"shape": name, "M": m, "N": n, "K": k}

        def us(fn):
            try:
                fn()
                return triton.testing.do_bench(fn, warmup=10, rep=60) * 1e3
            except Exception as e:  # noqa: BLE001 - report it, go on with the others
                print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                return float("nan")

        row["tensor"] = us(lambda: fp8_mm(ta, tb, torch.bfloat16, cur))
        row["tensor fast"] = us(lambda: fp8_mm(ta, tb, torch.bfloat16, cur, fast_accum=True))
        row["block cuBLAS"] = us(lambda: fp8_mm(qa, qb, torch.bfloat16, blk))
        sa_outer = qa.scale_inv.t().contiguous().t()
        sb_outer = qb.scale_inv.t().contiguous().t()
        runs = {}
        for c in configs:
            bm, bn, st, w, compact, unroll, ws, maxnreg, plain = CONFIGS[c]
            options = dict(block_m=bm, block_n=bn, stages=st, num_warps=w, compact=compact, unroll=unroll,
                           warp_specialized=ws, maxnreg=maxnreg, plain=plain)
            runs[c] = (lambda options=options: block_scaled_mm(qa.data, sa_outer, qb.data, sb_outer, b_rows,
                                                                **options))
            row[c] = us(runs[c])
        exact = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
        mag = qa.dequantize(torch.float64).abs() @ qb.dequantize(torch.float64).abs().t()
        mag = mag.clamp_min(1e-30)
        ref = fp8_mm(qa, qb, torch.bfloat16, blk).double()
        row["err cuBLAS"] = ((ref - exact).abs() / mag).max().item()
        for c in configs:
            try:
                got = runs[c]().double()
                row[f"err {c}"] = ((got - exact).abs() / mag).max().item()
                row[f"vs cuBLAS {c}"] = ((got - ref).abs() / mag).max().item()
            except Exception:  # noqa: BLE001 - its timing already reported it
                row[f"err {c}"] = float("nan")
        best = min((row[c] for c in configs if row[c] == row[c] and not CONFIGS[c][8]), default=float("nan"))
        row["best / cuBLAS"] = best / row["block cuBLAS"]
        row["best / tensor"] = best / row["tensor"]
        results.append(row)
        cells = [f"{row[c]:.1f}" for c in ["tensor", "tensor fast", "block cuBLAS"] + configs]
        cells += [f"{row['best / cuBLAS']:.3f}", f"{row['best / tensor']:.3f}", f"{row['err cuBLAS']:.1e}"]
        cells += [f"{row[f'err {c}']:.1e}" for c in configs]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        del exact, mag, ref
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
