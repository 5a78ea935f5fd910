"""The experts' grouped GEMMs on one GPU: does torch._scaled_grouped_mm take each of the three FP8
GEMMs (fsdp8/fp8/grouped_kernel.py), how far from the emulation, and what a forward + backward of
one expert projection costs as bf16 torch._grouped_mm, FP8 in one grouped kernel, and FP8 group
by group.

    python3 benchmarks/debug/grouped_fp8_gemms.py [--tokens 32768 --experts 32]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8 import grouped_kernel, triton_grouped  # noqa: E402
from fsdp8.fp8.formats import E4M3  # noqa: E402
from fsdp8.fp8.grouped import fp8_grouped_mm  # noqa: E402
from fsdp8.fp8.recipes import Float8CurrentScaling  # noqa: E402
from fsdp8.models.moe import grouped_mm  # noqa: E402


PROFILE = False
HOST = False


def check_each_gemm() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g, dtype=torch.bfloat16)
    w = torch.randn(3, 48, 32, generator=g, dtype=torch.bfloat16)
    dy = torch.randn(40, 48, generator=g, dtype=torch.bfloat16)
    offs = torch.tensor([7, 7, 40], dtype=torch.int32)
    want = grouped_kernel.three_gemms(x, w, dy, offs)
    cuda = [t.cuda() for t in (x, w, dy, offs)]
    groups = grouped_kernel.Groups(cuda[3])
    qx = grouped_kernel.quantize_groups(cuda[0], E4M3, groups, padded=True)
    qdy = grouped_kernel.quantize_groups(cuda[2], E4M3, groups, padded=True)
    qw, inv_w = grouped_kernel.quantize_experts(cuda[1], E4M3)
    calls = {
        "forward (2d-3d)": lambda: grouped_kernel.forward_gemm(qx, qw, inv_w, groups),
        "input grad (2d-3d)": lambda: grouped_kernel.input_grad_gemm(qdy, qw.transpose(1, 2).contiguous(), inv_w,
                                                                     groups),
        "weight grad (2d-2d)": lambda: grouped_kernel.weight_grad_gemm(qdy, qx, groups, x.shape[0]),
    }
    for (name, call), ref in zip(calls.items(), want):
        try:
            got = call()
            print(f"{name}: ok, relative error to the emulation {grouped_kernel._relative_error(got, ref):.2e}")
        except Exception:  # noqa: BLE001 -- a diagnosis: say what failed and go on
            print(f"{name}: FAILED\n{traceback.format_exc(limit=3)}")
    print("kernel_runs:", grouped_kernel.kernel_runs(torch.device("cuda")))


def timed(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def compare(tokens: int, experts: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    # Uneven groups: each expert's share drawn around tokens / experts.
    share = torch.rand(experts, generator=g, device="cuda") + 0.5
    sizes = (share / share.sum() * tokens).floor().long()
    sizes[-1] += tokens - sizes.sum()
    offs = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(tokens, k, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(experts, n, k, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    dy = torch.randn(tokens, n, device="cuda", generator=g, dtype=torch.bfloat16)
    flops = 6 * tokens * n * k

    def bf16():
        torch.autograd.backward(grouped_mm(x, w, offs), dy)

    def fp8(one_kernel: bool, fmt: str):
        def step():
            original = grouped_kernel.kernel_runs
            grouped_kernel.kernel_runs = lambda device: one_kernel and original(device)
            try:
                torch.autograd.backward(fp8_grouped_mm(x, w, offs, Float8CurrentScaling(fp8_format=fmt)), dy)
            finally:
                grouped_kernel.kernel_runs = original
        return step

    rows = [("bf16 torch._grouped_mm", bf16), ("FP8 e4m3, one grouped kernel", fp8(True, "e4m3")),
            ("FP8 hybrid, forward one kernel", fp8(True, "hybrid")), ("FP8 e4m3, group by group", fp8(False, "e4m3"))]
    print(f"\n| {tokens} rows, {experts} experts, [{n}, {k}] | fwd+bwd ms | TFLOP/s |\n|---|---:|---:|")
    for name, fn in rows:
        try:
            ms = timed(fn)
            print(f"| {name} | {ms:.2f} | {flops / ms / 1e9:.0f} |")
        except Exception as err:  # noqa: BLE001
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:120]} | |")
    if HOST:
        host_time(rows[0][0], rows[0][1])
        host_time(rows[1][0], rows[1][1])
    if PROFILE:
        for name, fn in rows[1:2]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            print(f"\n{name}, 3 calls:")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))


def host_time(name: str, fn) -> None:
    """The host's time to issue one call (no synchronisation inside the timed loop), each call that
    makes the host wait for the GPU (sync debug mode), and where the host time goes (cProfile)."""
    import cProfile
    import pstats
    import time
    import warnings

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        fn()
    issued = (time.perf_counter() - start) / 10 * 1e3
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message)[:100] for w in seen if "prototype" not in str(w.message)]
    print(f"\n{name}: host issues a call in {issued:.3f} ms; host waits for the GPU {len(syncs)} times: {syncs[:3]}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def kernels_alone(tokens: int, experts: int, n: int, k: int) -> None:
    """Each GEMM on operands quantized beforehand: the kernels' own speed, FP8 against bf16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.full((experts,), tokens // experts, device="cuda", dtype=torch.long)
    sizes[-1] += tokens - sizes.sum()
    offs = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(tokens, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(experts, n, k, device="cuda", generator=g) * 0.02).bfloat16()
    dy = torch.randn(tokens, n, device="cuda", generator=g, dtype=torch.bfloat16)
    groups = grouped_kernel.Groups(offs)
    qx_b, qdy_b = grouped_kernel.quantize_groups(x, E4M3, groups), grouped_kernel.quantize_groups(dy, E4M3, groups)
    group = groups.row_group(tokens)
    qx, inv_x, qdy, inv_dy = qx_b.data, qx_b.inv, qdy_b.data, qdy_b.inv
    qw, inv_w = grouped_kernel.quantize_experts(w, E4M3)
    qw_t = qw.transpose(1, 2).contiguous()
    sa_x, sa_dy = inv_x[group].contiguous(), inv_dy[group].contiguous()
    sb_n, sb_k = inv_w[:, None].expand(experts, n).contiguous(), inv_w[:, None].expand(experts, k).contiguous()
    a_dw, b_dw = qdy.t().contiguous(), qx.t().contiguous().t()  # equal groups of a multiple of 16 rows
    sa_dw, sb_dw = inv_dy.repeat_interleave(n), inv_x.repeat_interleave(k)
    x_t, dy_t, w_t = x.t().contiguous(), dy.t().contiguous(), w.transpose(1, 2).contiguous()
    gemm_flops = 2 * tokens * n * k
    rows = []
    for fast in (True, False):
        rows += [(f"FP8 forward x W^T (2d-3d), fast_accum={fast}",
                  lambda f=fast: torch._scaled_grouped_mm(qx, qw.transpose(1, 2), sa_x, sb_n, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=f)),
                 (f"FP8 input grad dy W (2d-3d), fast_accum={fast}",
                  lambda f=fast: torch._scaled_grouped_mm(qdy, qw_t.transpose(1, 2), sa_dy, sb_k, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=f)),
                 (f"FP8 weight grad dy^T x (2d-2d), fast_accum={fast}",
                  lambda f=fast: torch._scaled_grouped_mm(a_dw, b_dw, sa_dw, sb_dw, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=f))]
    rows += [("bf16 forward (2d-3d)", lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)),
             ("bf16 input grad (2d-3d)", lambda: torch._grouped_mm(dy, w_t.transpose(1, 2), offs=offs)),
             ("bf16 weight grad (2d-2d)", lambda: torch._grouped_mm(dy_t, x_t.t(), offs=offs))]
    print(f"\n| one GEMM, {tokens} rows, {experts} experts, [{n}, {k}] | ms | TFLOP/s |\n|---|---:|---:|")
    for name, fn in rows:
        try:
            ms = timed(fn, reps=20)
            print(f"| {name} | {ms:.3f} | {gemm_flops / ms / 1e9:.0f} |")
        except Exception as err:  # noqa: BLE001
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:120]} | |")
    column, _, width = groups.padded(tokens)
    steps = [("quantize_groups (x)", lambda: grouped_kernel.quantize_groups(x, E4M3, groups)),
             ("quantize_groups (x), padded too", lambda: grouped_kernel.quantize_groups(x, E4M3, groups, padded=True)),
             ("quantize_experts (w)", lambda: grouped_kernel.quantize_experts(w, E4M3)),
             ("padded transpose in torch (qx)", lambda: grouped_kernel._scatter_columns(qx, column, width)),
             ("eager x.abs().amax(1)", lambda: x.abs().amax(1)),
             ("eager vector_norm(x, inf, 1)", lambda: torch.linalg.vector_norm(x, float("inf"), dim=1)),
             ("eager qx.t().contiguous()", lambda: qx.t().contiguous()),
             ("torch qw.transpose(1, 2).contiguous()", lambda: qw.transpose(1, 2).contiguous()),
             ("Triton transpose_bytes(qw)", lambda: triton_grouped.transpose_bytes(qw))]
    # Bytes each must move at least: x read (bf16) and written as FP8 once, twice where padded.
    row_bytes, w_bytes = tokens * k * 3, experts * n * k
    floor = {"quantize_groups (x)": row_bytes + tokens * k * 2, "quantize_groups (x), padded too": row_bytes + tokens * k * 3,
             "torch qw.transpose(1, 2).contiguous()": 2 * w_bytes, "Triton transpose_bytes(qw)": 2 * w_bytes}
    print("\n| step | ms | GB/s |\n|---|---:|---:|")
    for name, fn in steps:
        ms = timed(fn, reps=20)
        print(f"| {name} | {ms:.3f} | {floor[name] / ms / 1e6:.0f} |" if name in floor else f"| {name} | {ms:.3f} | |")
    for bc, bk in ((64, 64), (128, 64), (64, 128), (128, 128), (32, 128)):
        triton_grouped.BC, triton_grouped.BK = bc, bk
        ms = timed(lambda: grouped_kernel.quantize_groups(x, E4M3, groups, padded=True), reps=20)
        print(f"| padded cast, tile {bc} x {bk} | {ms:.3f} | {floor['quantize_groups (x), padded too'] / ms / 1e6:.0f} |")
    triton_grouped.BC, triton_grouped.BK = 64, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="rows on one rank after dispatch (tokens x top-k)")
    p.add_argument("--experts", type=int, default=32, help="experts on one rank")
    p.add_argument("--kernels", action="store_true", help="each GEMM alone, FP8 and bf16, and the row passes")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of bf16 and FP8 in one kernel")
    p.add_argument("--host", action="store_true", help="host time per call, host waits and cProfile, bf16 and FP8")
    a = p.parse_args()
    global PROFILE, HOST
    PROFILE, HOST = a.profile, a.host
    print("torch", torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    check_each_gemm()
    if a.kernels:
        kernels_alone(a.tokens, a.experts, 1536, 2048)
        kernels_alone(a.tokens, a.experts, 2048, 768)
        return
    compare(a.tokens, a.experts, 1536, 2048)  # gate_up of model Q's experts
    compare(a.tokens, a.experts, 2048, 768)  # down


if __name__ == "__main__":
    main()
