"""Compiled 1x128 quantization, both ways, of an MLP gradient (model A's gate gradient,
dgate = dh * up * silu'(gate)), under Inductor settings: what a block-scaled linear's
backward does in a compiled block, isolated. Checks every variant's bytes against the
compiled reference, prints a table of milliseconds (median of --iters, CUDA events) and, with
--top, each variant's kernels.

    python benchmarks/debug/block_quant_compile.py [--tokens 8192] [--features 8192]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8.formats import E4M3, FP8_MAX, Granularity, amax_to_scale, scale_to_inv  # noqa: E402
from fsdp8.fp8.kernels import Quantized, cast_transpose, quantize_1x128_both_ways, quantize_reference  # noqa: E402


def dgate(gate, up, dh):
    sig = torch.sigmoid(gate.float())
    return (dh.float() * up.float() * sig * (1 + gate.float() * (1 - sig))).to(gate.dtype)


def reference(gate, up, dh):
    g = dgate(gate, up, dh)
    return quantize_reference(g, E4M3, Granularity.ROW_1x128), quantize_reference(g.t(), E4M3, Granularity.ROW_1x128)


def own_layout(gate, up, dh):
    """The column blocks' amaxes reduced in the tensor's own layout (128 rows of a column,
    neighbouring columns neighbours in memory), then transposed: the same bytes."""
    g = dgate(gate, up, dh)
    rows = quantize_reference(g, E4M3, Granularity.ROW_1x128)
    m, n = g.shape
    col_amax = g.float().abs().view(m // 128, 128, n).amax(dim=1)  # (m/128, n)
    scale = amax_to_scale(col_amax, E4M3)
    fmax = FP8_MAX[E4M3]
    q = (g.float().view(m // 128, 128, n) * scale[:, None, :]).clamp(-fmax, fmax).to(E4M3).view(m, n)
    return rows, (q.t().contiguous(), scale_to_inv(scale).t().contiguous())


def fsdp8_in_graph(gate, up, dh):
    """What a compiled block-scaled linear runs: kernels.quantize_1x128_both_ways, the Triton
    kernel as a graph op unless FSDP8_TRITON_OP=0."""
    return quantize_1x128_both_ways(dgate(gate, up, dh), E4M3)


def current(gate, up, dh):
    g = dgate(gate, up, dh)
    return cast_transpose(g, E4M3)


def rows_and_cols(g, warps):
    """fsdp8's eager Triton kernel (one 128x128 tile read once, quantized both ways) at a
    chosen number of warps, on the materialized gradient."""
    from fsdp8.fp8 import triton_kernels as tk

    m, k = g.shape
    q, qt = torch.empty((m, k), dtype=E4M3, device=g.device), torch.empty((k, m), dtype=E4M3, device=g.device)
    sinv = torch.empty((m, k // 128), dtype=torch.float32, device=g.device)
    sinv_t = torch.empty((k, m // 128), dtype=torch.float32, device=g.device)
    tk._rows_and_cols_kernel[(m // 128, k // 128)](g, q, qt, sinv, sinv_t, m, k, g.stride(0), g.stride(1), k // 128,
                                                   m // 128, FMAX=FP8_MAX[E4M3], OUT=tk._tl_dtype(E4M3),
                                                   RELOAD_T=False, B=128, num_warps=warps)
    return q, sinv, qt, sinv_t


def comparable(t):
    """FP8 bytes as uint8 (torch.equal compares their bits), anything else as fp32."""
    return t.view(torch.uint8) if t.dtype == E4M3 else t.float()


def flat(result):
    out = []
    for item in result:
        if isinstance(item, Quantized):
            out += [item.data, item.scale_inv]
        elif isinstance(item, (tuple, list)):
            out += flat(item)
        else:
            out.append(item)
    return out


def timed(fn, args, iters):
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(*args)
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


SETTINGS = {
    "default": {},
    "tile_reductions": {"triton.tile_reductions": True, "triton.prefer_nd_tiling": True},
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--features", type=int, default=8192)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--top", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    shape = (args.tokens, args.features)
    gate, up, dh = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    inputs = (gate, up, dh)
    # Against the compiled reference with default settings: the compiled gradient itself
    # may differ from eager's in its last bit (fused float ops), and is the same for all.
    expected = [comparable(t) for t in flat(torch.compile(reference)(*inputs))]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, dgate {shape} bf16 -> 1x128 both ways, e4m3")
    gbytes = 3 * gate.numel() * 2 + 2 * gate.numel()  # read three bf16 inputs, write two FP8 copies
    print("| variant | settings | ms | GB/s (3 bf16 in, 2 fp8 out) | bytes equal |")
    print("|---|---|---:|---:|---|")
    variants = (("reference", reference), ("own_layout", own_layout), ("fsdp8 in graph (triton_op)", fsdp8_in_graph))
    for name, fn in variants:
        for setting, patch in SETTINGS.items():
            torch._dynamo.reset()
            with torch._inductor.config.patch(patch):
                compiled = torch.compile(fn)
                got = flat(compiled(*inputs))
                ms = timed(compiled, inputs, args.iters)
                if args.top:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        compiled(*inputs)
                        torch.cuda.synchronize()
            same = len(got) == len(expected) and all(torch.equal(comparable(g), e) for g, e in zip(got, expected))
            print(f"| {name} | {setting} | {ms:.3f} | {gbytes / ms / 1e6:.0f} | {same} |", flush=True)
            if args.top:
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top,
                                                max_name_column_width=90), flush=True)
    g = torch.compile(dgate)(*inputs)
    ms = timed(torch.compile(dgate), inputs, args.iters)
    moved = 3 * g.numel() * 2 + g.numel() * 2
    print(f"| dgate alone (compiled pointwise) | default | {ms:.3f} | {moved / ms / 1e6:.0f} (3 bf16 in, 1 out) | - |")
    ref_g = flat((quantize_reference(g, E4M3, Granularity.ROW_1x128),
                  quantize_reference(g.t(), E4M3, Granularity.ROW_1x128)))
    want = [comparable(t) for t in ref_g]
    for warps in (4, 8, 16):
        got = rows_and_cols(g, warps)
        same = all(torch.equal(comparable(a), b) for a, b in zip(got, want))
        ms = timed(lambda: rows_and_cols(g, warps), (), args.iters)
        print(f"| triton both-ways kernel on dgate | num_warps={warps} | {ms:.3f} | {3 * g.numel() / ms / 1e6:.0f} "
              f"(1 bf16 in, 2 fp8 out) | {same} |", flush=True)
    for name, fn in (("current (cast_transpose)", torch.compile(current)),):
        torch._dynamo.reset()
        ms = timed(fn, inputs, args.iters)
        print(f"| {name} | default | {ms:.3f} | {gbytes / ms / 1e6:.0f} | - |", flush=True)


if __name__ == "__main__":
    main()
