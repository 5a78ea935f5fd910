"""Experiment: FP8 GEMMs whose scales change along K, written in Triton for Hopper,
against bf16, the MXFP8 emulation and cuBLAS's tensorwise and blockwise FP8 GEMMs.

    python benchmarks/debug/kblock_gemm.py [--tokens 8192] [--out results.json]

The kernel: ``a @ b.T`` for row-major FP8 ``a`` (M, K) and ``b`` (N, K), each with one fp32
``scale_inv`` per ``sk`` consecutive elements of a row (``b`` may share one per ``b_rows``
rows: 128x128 weight blocks). The sum over K is split at the scale boundaries: each
``sk``-deep piece is one FP8 tensor-core product, scaled by the outer product of its row and
column scales and added to an fp32 accumulator; ``dequant=True`` instead scales the FP8 tiles
into bf16 in registers and runs bf16 MMAs.

Why it is not in the library: the rescaling runs on the CUDA cores, two operations per
accumulator element per piece, while the piece's MMA costs ``sk`` tensor-core FMAs. On an
H100 (4,096 FP8 FMAs against 128 fp32 operations per clock and SM) a 32-deep MX piece's
rescaling takes twice its MMA and as long as a bf16 MMA of the same depth, so MXFP8 on
Hopper cannot beat bf16 GEMM speed whatever the kernel. Measured (docs/PERFORMANCE.md) it
ran at 190-250 TFLOP/s against cuBLAS bf16's 700-790, and for 1x128 x 128x128 blocks at half
cuBLAS's blockwise speed. fsdp8 keeps the exact emulation (dequantize, bf16 GEMM), which
torch.compile fuses into the neighbouring ops.

For each shape of models A and B (forward: M tokens x K in -> N out; weight gradient: K =
tokens), TFLOP/s (2*M*N*K / time, triton.testing.do_bench median) and each kernel's largest
error against the exact product of the dequantized operands, in units of
sum_k |a_k||b_k| (the scale of the rounding a derived bound allows).
"""

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from fsdp8.fp8.formats import Granularity
from fsdp8.fp8.kernels import quantize
from fsdp8.fp8.gemm import fp8_mm
from fsdp8.fp8.recipes import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

E4M3 = torch.float8_e4m3fn


def check_operands(a, sa, b, sb, sk: int, b_rows: int) -> None:
    m, k = a.shape
    n, k_b = b.shape
    if k != k_b:
        raise ValueError(f"kblock_mm: a is (M, K) = {tuple(a.shape)} and b (N, K) = {tuple(b.shape)}; their K differ")
    if k % sk:
        raise ValueError(f"kblock_mm: K = {k} is not a multiple of the scale block {sk}")
    want_sb = (-(-n // b_rows), k // sk)
    if tuple(sa.shape) != (m, k // sk) or tuple(sb.shape) != want_sb:
        raise ValueError(f"kblock_mm: scales {tuple(sa.shape)} and {tuple(sb.shape)} do not fit a {tuple(a.shape)} and "
                         f"b {tuple(b.shape)} with {sk}-deep blocks ({(m, k // sk)} and {want_sb} expected)")


def _configs():
    shapes = [(128, 128, 8, 4), (128, 256, 8, 3), (128, 128, 4, 5), (64, 128, 4, 6), (128, 64, 4, 6)]
    return [triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]

@triton.autotune(configs=_configs(), key=["M", "N", "K", "SK", "B_ROWS", "DEQUANT"])
@triton.jit
def _kblock_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K, KS,
                      SK: tl.constexpr, B_ROWS: tl.constexpr, DEQUANT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs walk the output in groups of GROUP_M row tiles so neighbours share b in L2.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rm_in = tl.where(rm < M, rm, 0)  # edge tiles read row 0 again; their results are not stored
    rn_in = tl.where(rn < N, rn, 0)
    rk = tl.arange(0, SK)
    a_ptrs = a_ptr + rm_in[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + rn_in[None, :] * K + rk[:, None]  # (SK, BN), K-major as FP8 MMAs want it
    sa_row = sa_ptr + rm_in * KS
    sb_col = sb_ptr + (rn_in // B_ROWS) * KS
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, SK):  # one piece per scale block
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        sa = tl.load(sa_row + k0 // SK)
        sb = tl.load(sb_col + k0 // SK)
        if DEQUANT:  # scaled into bf16 (exact: powers of two), then a bf16 MMA
            a16 = (a.to(tl.float32) * sa[:, None]).to(tl.bfloat16)
            b16 = (b.to(tl.float32) * sb[None, :]).to(tl.bfloat16)
            acc = tl.dot(a16, b16, acc)
        else:
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += SK
        b_ptrs += SK
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def kblock_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, sk: int, b_rows: int = 1,
              out_dtype: torch.dtype = torch.bfloat16, dequant: bool = False) -> torch.Tensor:
    """``a @ b.T`` with per-``sk`` K-block scales, on the GPU's FP8 tensor cores (see module doc)."""
    check_operands(a, sa, b, sb, sk, b_rows)
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("kblock_mm takes row-major (contiguous) FP8 operands")
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
    _kblock_mm_kernel[grid](a, b, sa.float().contiguous(), sb.float().contiguous(), c, m, n, k, k // sk,
                            SK=sk, B_ROWS=b_rows, DEQUANT=dequant)
    return c


def shapes(tokens):
    rows = []
    for model, h, ffn, kv in (("A", 2048, 8192, 1024), ("B", 4096, 14336, 1024)):
        for name, k, n in (("qo", h, h), ("kv", h, kv), ("gate/up", h, ffn), ("down", ffn, h)):
            rows.append((f"{model} {name} fwd", tokens, n, k))
        rows.append((f"{model} gate/up wgrad", h, ffn, tokens))
    return rows


def err(run, exact, mag):
    try:
        return ((run().float() - exact).abs() / mag.clamp_min(1e-30)).max().item()
    except Exception:  # noqa: BLE001 - its timing already reported the failure
        return float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    columns = ["shape", "M", "N", "K", "bf16", "tensorwise cuBLAS", "block cuBLAS", "block triton", "MX emulated",
               "MX triton fp8-mma", "MX triton dequant", "err block triton", "err MX fp8-mma", "err MX dequant"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name, m, n, k in shapes(args.tokens):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        flops = 2 * m * n * k
        row = {"shape": name, "M": m, "N": n, "K": k}

        def tf(fn):
            try:
                return flops / triton.testing.do_bench(fn, warmup=10, rep=50) / 1e9
            except Exception as e:  # noqa: BLE001 - report it and go on with the other kernels
                print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                return float("nan")

        row["bf16"] = tf(lambda: x @ w.t())
        qx_t, qw_t = quantize(x, E4M3, Granularity.TENSOR), quantize(w, E4M3, Granularity.TENSOR)
        cur = Float8CurrentScaling()
        row["tensor_cublas"] = tf(lambda: fp8_mm(qx_t, qw_t, torch.bfloat16, cur, fast_accum=True))
        qx_r, qw_b = quantize(x, E4M3, Granularity.ROW_1x128), quantize(w, E4M3, Granularity.BLOCK_128x128)
        blk = Float8BlockScaling()
        row["block_cublas"] = tf(lambda: fp8_mm(qx_r, qw_b, torch.bfloat16, blk))
        block_tr = lambda: kblock_mm(qx_r.data, qx_r.scale_inv, qw_b.data, qw_b.scale_inv, 128, 128)  # noqa: E731
        row["block_triton"] = tf(block_tr)
        qx_m, qw_m = quantize(x, E4M3, Granularity.MX_1x32), quantize(w, E4M3, Granularity.MX_1x32)
        mx = MXFP8BlockScaling()
        row["mx_emulated"] = tf(lambda: fp8_mm(qx_m, qw_m, torch.bfloat16, mx))
        mx_mma = lambda: kblock_mm(qx_m.data, qx_m.scale_inv, qw_m.data, qw_m.scale_inv, 32)  # noqa: E731
        mx_deq = lambda: kblock_mm(qx_m.data, qx_m.scale_inv, qw_m.data, qw_m.scale_inv, 32, dequant=True)  # noqa: E731
        row["mx_triton_mma"] = tf(mx_mma)
        row["mx_triton_dequant"] = tf(mx_deq)
        mag_b = qx_r.dequantize().abs() @ qw_b.dequantize().abs().t()
        row["err_block_triton"] = err(block_tr, qx_r.dequantize() @ qw_b.dequantize().t(), mag_b)
        mag_m = qx_m.dequantize().abs() @ qw_m.dequantize().abs().t()
        exact_m = qx_m.dequantize() @ qw_m.dequantize().t()
        row["err_mx_mma"] = err(mx_mma, exact_m, mag_m)
        row["err_mx_dequant"] = err(mx_deq, exact_m, mag_m)
        row["err_mx_emulated"] = err(lambda: fp8_mm(qx_m, qw_m, torch.bfloat16, mx), exact_m, mag_m)
        results.append(row)
        speeds = " | ".join(f"{row[c]:.0f}" for c in ("bf16", "tensor_cublas", "block_cublas", "block_triton",
                                                      "mx_emulated", "mx_triton_mma", "mx_triton_dequant"))
        errs = " | ".join(f"{row[c]:.1e}" for c in ("err_block_triton", "err_mx_mma", "err_mx_dequant"))
        print(f"| {name} | {m} | {n} | {k} | {speeds} | {errs} |", flush=True)
        del mag_b, mag_m, exact_m
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
