"""The 128x128 block amaxes of every FP8 weight of model A (fp32 main weights, 16 layers x 7
linears, one launch), as the engine takes them before each step under block scaling:
fsdp8's kernel (each block read in chunks of rows) against its first version (a whole
block at once), and at other chunk heights and warp counts. Checks each result
against the torch reference bit for bit and prints GPU time (CUDA events, median of 30)
and the achieved read bandwidth.

    python benchmarks/debug/block_amax_kernels.py [--hidden 2048 --ffn 8192 --kv 512 --layers 16]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8 import triton_kernels  # noqa: E402
from fsdp8.fp8.kernels import partial_block_amax  # noqa: E402


@triton.jit
def _whole_block_kernel(table_ptr, out_ptr, T, IN: tl.constexpr, B: tl.constexpr):
    j, t = tl.program_id(0), tl.program_id(1)
    grid_cols = tl.load(table_ptr + 5 * T + t)
    touched = tl.load(table_ptr + 7 * T + t)
    if j < touched * grid_cols:
        base = tl.load(table_ptr + t).to(tl.pointer_type(IN))
        rows = tl.load(table_ptr + T + t)
        cols = tl.load(table_ptr + 2 * T + t)
        row_start = tl.load(table_ptr + 3 * T + t)
        block_row = tl.load(table_ptr + 6 * T + t) + j // grid_cols
        block_col = j % grid_cols
        r = block_row * B - row_start + tl.arange(0, B)
        c = block_col * B + tl.arange(0, B)
        mask = (r[:, None] >= 0) & (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(base + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
        tile = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0) > 0
        out = tl.load(table_ptr + 4 * T + t) + block_row * grid_cols + block_col
        tl.store(out_ptr + out, tl.where(has_nan, float("nan"), tile))


def _launch(pieces, kernel, **meta):
    device = pieces[0][0].device
    columns, offset, longest = [], 0, 0
    for rows, start, total in pieces:
        n, cols = rows.shape
        grid_rows, grid_cols = triton.cdiv(total, 128), triton.cdiv(cols, 128)
        first = start // 128
        touched = triton.cdiv(start + n, 128) - first if n else 0
        columns.append((rows.data_ptr(), n, cols, start, offset, grid_cols, first, touched))
        offset += grid_rows * grid_cols
        longest = max(longest, touched * grid_cols)
    table = triton_kernels._device_table(device, tuple(v for field in zip(*columns) for v in field))
    out = torch.zeros(offset, dtype=torch.float32, device=device)
    kernel[(longest, len(pieces))](table, out, len(pieces), IN=tl.float32, B=128, **meta)
    return out


def whole_block(pieces, warps):
    """The first version: each program read its whole 128x128 block at once."""
    return _launch(pieces, _whole_block_kernel, num_warps=warps)


def chunked(pieces, rb, warps):
    """fsdp8's kernel at another chunk height and warp count."""
    return _launch(pieces, triton_kernels._block_amax_grids_kernel, RB=rb, num_warps=warps)


def timed(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--kv", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    args = p.parse_args()
    h, f, kv = args.hidden, args.ffn, args.kv
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)] * args.layers
    torch.manual_seed(0)
    weights = [torch.randn(s, device="cuda") for s in shapes]
    pieces = [(w, 0, w.shape[0]) for w in weights]
    expected = torch.cat([partial_block_amax(w, 0, w.shape[0]).flatten() for w in weights])
    gbytes = sum(w.numel() for w in weights) * 4 / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}: "
          f"{len(weights)} fp32 weights, {gbytes:.2f} GB")
    print("| kernel | rows per step | warps | ms | TB/s | equal |")
    print("|---|---:|---:|---:|---:|---|")
    got = whole_block(pieces, 8)
    ms = timed(lambda: whole_block(pieces, 8))
    print(f"| whole block (first version) | 128 | 8 | {ms:.3f} | {gbytes / ms:.2f} | {torch.equal(got, expected)} |",
          flush=True)
    got = triton_kernels.block_amax_grids(pieces)
    ms = timed(lambda: triton_kernels.block_amax_grids(pieces))
    print(f"| fsdp8 (block_amax_grids) | 8 | 4 | {ms:.3f} | {gbytes / ms:.2f} | {torch.equal(got, expected)} |",
          flush=True)
    for rb in (2, 4, 8, 16, 32):
        for warps in (2, 4, 8):
            got = chunked(pieces, rb, warps)
            ms = timed(lambda: chunked(pieces, rb, warps))
            print(f"| chunked | {rb} | {warps} | {ms:.3f} | {gbytes / ms:.2f} | {torch.equal(got, expected)} |",
                  flush=True)


if __name__ == "__main__":
    main()
