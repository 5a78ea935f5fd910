"""Does cuBLASLt have a faster blockwise FP8 kernel than the one torch._scaled_mm gets?

torch asks cuBLASLt's heuristic for one algorithm and runs it. This script asks for many,
for each of model A's block-scaled GEMMs (1x128 x 128x128 forward and input gradient, 1x128 x
1x128 weight gradient), runs each one through ctypes on the same operands and scale tensors
torch passes, checks its output against torch._scaled_mm's, and times it. A row per algorithm:
its tile, stages and cluster ids, microseconds (median of CUDA-event timings over --iters
launches), and the largest difference from torch's output relative to the output's largest
magnitude (different kernels sum in different orders).

    python benchmarks/debug/cublaslt_block_algos.py [--tokens 8192] [--algos 32] [--exhaustive]

--exhaustive also walks cublasLtMatmulAlgoGetIds: every algorithm id, every tile and stages id
it reports, each checked by cublasLtMatmulAlgoCheck before it is timed.

Enum values are from cuBLAS 13's cublasLt.h.
"""

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8.formats import E4M3, Granularity  # noqa: E402
from fsdp8.fp8.kernels import quantize  # noqa: E402
from fsdp8.fp8.gemm import _outer_major  # noqa: E402

# cublasLt.h / cublas_api.h / library_types.h
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_VEC128_32F, SCALE_BLK128x128_32F = 4, 5
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM, CONFIG_STAGES_ID, CONFIG_CLUSTER_SHAPE_ID = 0, 1, 2, 6, 8
CONFIG_REDUCTION_SCHEME, CONFIG_CTA_SWIZZLING, CONFIG_CUSTOM_OPTION, CONFIG_INNER_SHAPE_ID = 3, 4, 5, 7
CAP_TILE_IDS, CAP_STAGES_IDS = 6, 13
OP_N, OP_T = 0, 1
R_32F, R_16BF, R_8F_E4M3 = 0, 14, 28
COMPUTE_32F = 68
WORKSPACE = 32 * 1024 * 1024


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _load_cublaslt():
    torch.zeros(1, device="cuda") @ torch.zeros(1, 1, device="cuda").squeeze(1)  # cuBLAS is loaded by now
    for line in open("/proc/self/maps"):
        if "libcublasLt.so" in line:
            return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("libcublasLt is not loaded in this process")


LT = None


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


def set_attr(setter, obj, attr, value):
    check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


class Problem:
    """D (M x N, row-major bf16) = a (M x K) @ b (N x K).T with block scales, in cuBLAS's
    column-major terms: D^T (N x M) = op(A) B with A = b (K x N, transposed), B = a (K x M)."""

    def __init__(self, handle, a, b, a_mode, b_mode, a_scale, b_scale):
        self.handle, self.a, self.b, self.a_scale, self.b_scale = handle, a, b, a_scale, b_scale
        self.m, self.k = a.shape
        self.n = b.shape[0]
        self.out = torch.empty(self.m, self.n, device="cuda", dtype=torch.bfloat16)
        self.workspace = torch.empty(WORKSPACE, device="cuda", dtype=torch.uint8)
        self.desc = ctypes.c_void_p()
        check(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        sd = LT.cublasLtMatmulDescSetAttribute
        set_attr(sd, self.desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        set_attr(sd, self.desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        # cuBLAS's A is our b, its B our a.
        set_attr(sd, self.desc, DESC_A_SCALE_MODE, ctypes.c_int32(b_mode))
        set_attr(sd, self.desc, DESC_B_SCALE_MODE, ctypes.c_int32(a_mode))
        set_attr(sd, self.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale.data_ptr()))
        set_attr(sd, self.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale.data_ptr()))
        self.layouts = []
        for rows, cols, ld, dtype in ((self.k, self.n, self.k, R_8F_E4M3), (self.k, self.m, self.k, R_8F_E4M3),
                                      (self.n, self.m, self.n, R_16BF), (self.n, self.m, self.n, R_16BF)):
            layout = ctypes.c_void_p()
            check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                                ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
            self.layouts.append(layout)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def heuristic(self, count):
        pref = ctypes.c_void_p()
        check(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        set_attr(LT.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE))
        results = (HeuristicResult * count)()
        returned = ctypes.c_int()
        check(LT.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, *self.layouts, pref, count, results,
                                                ctypes.byref(returned)), "heuristic")
        self.heuristic_workspace = [results[i].workspaceSize for i in range(returned.value)]
        return [results[i].algo for i in range(returned.value) if results[i].state == 0]

    def exhaustive(self, limit):
        ids = (ctypes.c_int * 256)()
        found = ctypes.c_int()
        check(LT.cublasLtMatmulAlgoGetIds(self.handle, COMPUTE_32F, R_32F, R_8F_E4M3, R_8F_E4M3, R_16BF, R_16BF,
                                          256, ids, ctypes.byref(found)), "algo ids")
        algos = []
        for algo_id in ids[:found.value]:
            base = Algo()
            if LT.cublasLtMatmulAlgoInit(self.handle, COMPUTE_32F, R_32F, R_8F_E4M3, R_8F_E4M3, R_16BF, R_16BF,
                                         algo_id, ctypes.byref(base)) != 0:
                continue
            tiles, stages = self._cap_list(base, CAP_TILE_IDS) or [0], self._cap_list(base, CAP_STAGES_IDS) or [0]
            for tile in tiles:
                for stage in stages:
                    algo = Algo()
                    ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
                    sa = LT.cublasLtMatmulAlgoConfigSetAttribute
                    set_attr(sa, ctypes.byref(algo), CONFIG_TILE_ID, ctypes.c_uint32(tile))
                    set_attr(sa, ctypes.byref(algo), CONFIG_STAGES_ID, ctypes.c_uint32(stage))
                    result = HeuristicResult()
                    if LT.cublasLtMatmulAlgoCheck(self.handle, self.desc, *self.layouts, ctypes.byref(algo),
                                                  ctypes.byref(result)) == 0 and result.workspaceSize <= WORKSPACE:
                        algos.append(algo)
                    if len(algos) >= limit:
                        return algos
        return algos

    def _cap_list(self, algo, cap):
        written = ctypes.c_size_t()
        LT.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), cap, None, 0, ctypes.byref(written))
        if written.value == 0:
            return []
        values = (ctypes.c_uint32 * (written.value // 4))()
        check(LT.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), cap, values, written.value,
                                                   ctypes.byref(written)), "cap")
        return list(values)

    def run(self, algo):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        return LT.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(self.b.data_ptr()),
                                 self.layouts[0], ctypes.c_void_p(self.a.data_ptr()), self.layouts[1],
                                 ctypes.byref(self.beta), ctypes.c_void_p(self.out.data_ptr()), self.layouts[2],
                                 ctypes.c_void_p(self.out.data_ptr()), self.layouts[3], ctypes.byref(algo),
                                 ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE), stream)


def config(algo):
    values = []
    for attr in (CONFIG_ID, CONFIG_TILE_ID, CONFIG_STAGES_ID, CONFIG_CLUSTER_SHAPE_ID, CONFIG_SPLITK_NUM,
                 CONFIG_REDUCTION_SCHEME, CONFIG_CTA_SWIZZLING, CONFIG_CUSTOM_OPTION, CONFIG_INNER_SHAPE_ID):
        v = ctypes.c_uint32()
        written = ctypes.c_size_t()
        LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4, ctypes.byref(written))
        values.append(v.value)
    return "id {} tile {} stages {} cluster {} splitk {} reduction {} swizzle {} custom {} inner {}".format(*values)


def timed_us(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return statistics.median(times)


def kernels_of(fn):
    """Names and microseconds of the GPU kernels one call of ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:70], round(e.device_time, 1)) for e in prof.events() if e.device_time > 0]


LINEARS = {"q/o": (2048, 2048), "k/v": (1024, 2048), "gate/up": (8192, 2048), "down": (2048, 8192)}


def main():
    global LT
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--algos", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--exhaustive", action="store_true")
    p.add_argument("--limit", type=int, default=200, help="most algorithms timed per GEMM with --exhaustive")
    p.add_argument("--profile", action="store_true", help="list the kernels of one torch._scaled_mm call and one "
                   "of the heuristic's first algorithm, per GEMM (torch.profiler)")
    args = p.parse_args()
    LT = _load_cublaslt()
    version = LT.cublasLtGetVersion()
    handle = ctypes.c_void_p()
    check(LT.cublasLtCreate(ctypes.byref(handle)), "create")
    torch.manual_seed(0)
    t = args.tokens
    row, grid = Granularity.ROW_1x128, Granularity.BLOCK_128x128
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cublasLt {version}, tokens {t}")
    print("| linear | GEMM | algorithm | us | against torch's | max diff |")
    print("|---|---|---|---:|---:|---:|")
    summary = []
    for name, (n, k) in LINEARS.items():
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 0.01
        gemms = {
            "forward": (quantize(x, E4M3, row), quantize(w, E4M3, grid)),
            "input grad": (quantize(dy, E4M3, row), quantize(w.t().contiguous(), E4M3, grid)),
            "weight grad": (quantize(dy.t().contiguous(), E4M3, row), quantize(x.t().contiguous(), E4M3, row)),
        }
        for gemm, (a, b) in gemms.items():
            # The scale tensors exactly as fsdp8.fp8.gemm.fp8_mm hands them to torch._scaled_mm.
            a_scale = _outer_major(a.scale_inv)
            if b.granularity is grid:
                b_scale, b_mode = _outer_major(b.scale_inv.t()), SCALE_BLK128x128_32F
            else:
                b_scale, b_mode = b.scale_inv.t().contiguous(), SCALE_VEC128_32F
            ref = torch._scaled_mm(a.data, b.data.t(), a_scale, b_scale, out_dtype=torch.bfloat16)
            torch_us = timed_us(lambda: torch._scaled_mm(a.data, b.data.t(), a_scale, b_scale,
                                                         out_dtype=torch.bfloat16), args.iters)
            prob = Problem(handle, a.data, b.data, SCALE_VEC128_32F, b_mode, a_scale, b_scale)
            algos = prob.heuristic(args.algos)
            n_heuristic = len(algos)
            if args.exhaustive:
                algos += prob.exhaustive(args.limit)
            print(f"| {name} ({n} x {k}) | {gemm} | torch._scaled_mm | {torch_us:.1f} | 1.000 | 0 |", flush=True)
            if args.profile and algos:
                for label, fn in (("torch", lambda: torch._scaled_mm(a.data, b.data.t(), a_scale, b_scale,
                                                                     out_dtype=torch.bfloat16)),
                                  ("ctypes", lambda: prob.run(algos[0]))):
                    print(f"    {label} kernels: {kernels_of(fn)}; heuristic workspace {prob.heuristic_workspace[:1]}")
            best = (torch_us, "torch")
            for i, algo in enumerate(algos):
                prob.out.zero_()
                status = prob.run(algo)
                if status != 0:
                    print(f"| | | {i}: {config(algo)} | failed ({status}) | | |")
                    continue
                torch.cuda.synchronize()
                scale = ref.float().abs().max().item()
                diff = (prob.out.float() - ref.float()).abs().max().item() / scale
                us = timed_us(lambda: prob.run(algo), args.iters)
                source = "heuristic" if i < n_heuristic else "exhaustive"
                print(f"| | | {i} ({source}): {config(algo)} | {us:.1f} | {us / torch_us:.3f} | {diff:.1e} |",
                      flush=True)
                if diff < 1e-2 and us < best[0]:
                    best = (us, config(algo))
            summary.append((name, gemm, torch_us, best))
    print("\n| linear | GEMM | torch us | best us | best / torch | best algorithm |")
    print("|---|---|---:|---:|---:|---|")
    for name, gemm, torch_us, (us, what) in summary:
        print(f"| {name} | {gemm} | {torch_us:.1f} | {us:.1f} | {us / torch_us:.3f} | {what} |")


if __name__ == "__main__":
    main()
