"""The FP8 gather pack of one model-B decoder layer on one GPU: one launch per weight
(quantize_rows_with_grid; until 2026-11-24 its own kernel, now a one-piece launch of the
pack kernels) against the one-launch quantize_pieces at several block sizes and warp counts;
then the same for 128x128 block scales (quantize_block_pieces at several rows per tile and
warp counts). Every row's bytes are checked against the torch code's. Prints GPU time per pack (CUDA events, median of 50),
host time per pack (launches only) and the achieved bandwidth (4 bytes read + 1 written per
element). --world W packs this rank's rows of a W-way shard (default 2).

    python benchmarks/debug/pack_kernels.py [--world 2]
"""

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8 import triton_weights  # noqa: E402
from fsdp8.fp8.formats import E4M3, Granularity  # noqa: E402
from fsdp8.fp8.weight_kernels import quantize_rows_with_grid  # noqa: E402

H, I, KV = 4096, 14336, 1024
SHAPES = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]  # q k v o gate up down


def timed(fn, reps=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(s.elapsed_time(e))
    return statistics.median(gpu), statistics.median(host)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    rows = [(r // args.world, c) for r, c in SHAPES]
    sizes = [r * c for r, c in rows]
    total = sum(sizes)
    main_buf = torch.randn(total + 8192, device="cuda") * 0.02
    out = torch.empty(total + 8192, dtype=torch.uint8, device="cuda")
    scales = torch.rand(len(rows) * 4, device="cuda") * 1000 + 1
    pieces, s_off, o_off = [], 4096, 8192  # norms first, as in the engine's layouts
    for i, n in enumerate(sizes):
        pieces.append((s_off, o_off - 8192 + 4096, n, 4 * i))
        s_off += n
        o_off += n
    views = [main_buf[s : s + n].view(r, c) for (s, _, n, _), (r, c) in zip(pieces, rows)]
    outs = [out[o : o + n].view(E4M3).view(r, c) for (_, o, n, _), (r, c) in zip(pieces, rows)]

    def per_weight():
        for v, o, (_, _, _, k) in zip(views, outs, pieces):
            quantize_rows_with_grid(v, 0, scales[k], Granularity.TENSOR, E4M3, via=torch.bfloat16, out=o)

    gbytes = total * 5 / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one layer at world {args.world}: "
          f"{total / 1e6:.1f}M elements")
    variants = [(f"pieces block {block} warps {warps}",
                 functools.partial(triton_weights.quantize_pieces, main_buf, out.view(E4M3), scales, tuple(pieces), E4M3,
                                   torch.bfloat16, block=block, num_warps=warps))
                for block in (1024, 2048, 4096, 8192) for warps in (4, 8)]
    table("pack", per_weight, variants, out, gbytes)
    block_scales(args.world, rows, pieces, views, outs, main_buf, out, gbytes)


def table(title, per_weight, variants, out, gbytes):
    """GPU and host ms of ``per_weight`` (one launch per weight) and of each one-launch variant,
    every one's bytes checked against the torch code's (FSDP8_TRITON=0)."""
    os.environ["FSDP8_TRITON"] = "0"
    out.zero_()
    per_weight()
    expected = out.clone()
    del os.environ["FSDP8_TRITON"]
    print(f"\n| {title} | GPU ms | host ms | TB/s |\n|---|---|---|---|")
    for label, fn in [("per weight (7 launches)", per_weight)] + variants:
        out.zero_()
        fn()
        same = torch.equal(out, expected)
        g, h = timed(fn)
        print(f"| {label}{'' if same else ' (DIFFERENT BYTES)'} | {g:.3f} | {h:.3f} | {gbytes / g:.2f} |", flush=True)


def block_scales(world, rows, pieces, views, outs, main_buf, out, gbytes):
    """128x128 scales: this rank's rows start at rank 1's first row of each weight."""
    grids, g_off, block_pieces = [], 0, []
    for (s_off, o_off, _, _), (r, c) in zip(pieces, rows):
        start = r  # rank 1 of 2 (world rows per weight)
        total = r * world
        shape = ((total + 127) // 128, (c + 127) // 128)
        grids.append(torch.rand(shape, device="cuda") * 1000 + 1)
        block_pieces.append((s_off, o_off, r, c, start, g_off))
        g_off += shape[0] * shape[1]
    flat_scales = torch.cat([g.flatten() for g in grids])

    def per_weight():
        for v, o, (_, _, _, _, start, _), g in zip(views, outs, block_pieces, grids):
            quantize_rows_with_grid(v, start, g, Granularity.BLOCK_128x128, E4M3, via=torch.bfloat16, out=o)

    variants = [(f"pieces, {tile_rows} rows per tile, warps {warps}",
                 functools.partial(triton_weights.quantize_block_pieces, main_buf, out.view(E4M3), flat_scales,
                                   tuple(block_pieces), E4M3, torch.bfloat16, rows_per_tile=tile_rows, num_warps=warps))
                for tile_rows in (8, 16, 32, 64) for warps in (4, 8)]
    table("128x128 pack", per_weight, variants, out, gbytes)


if __name__ == "__main__":
    main()
