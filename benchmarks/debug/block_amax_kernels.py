"""The 128x128 block amaxes of every FP8 weight of model A (fp32 main weights, 16 layers x 7
linears, one launch), as the engine takes them before each step under block scaling:
fsdp8's kernel at several chunk heights (rows of a block read per step) and warp counts;
128 rows and 8 warps is its first version (a whole block at once). Checks each result
against the torch reference bit for bit and prints GPU time (CUDA events, median of 30)
and the achieved read bandwidth.

    python benchmarks/debug/block_amax_kernels.py [--hidden 2048 --ffn 8192 --kv 512 --layers 16]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8 import triton_weights  # noqa: E402
from fsdp8.fp8.weight_kernels import partial_block_amax  # noqa: E402
from block_quant_compile import timed  # noqa: E402  (this folder is on the path when run as a script)


def main():
    import triton

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
    for rb, warps in [(128, 8)] + [(rb, w) for rb in (2, 4, 8, 16, 32) for w in (2, 4, 8)]:
        got = triton_weights.block_amax_grids(pieces, rb, warps)
        ms = timed(triton_weights.block_amax_grids, (pieces, rb, warps), 30)
        name = {128: "first version (whole block at once)", 8: "fsdp8 default" if warps == 4 else ""}.get(rb, "")
        print(f"| {name} | {rb} | {warps} | {ms:.3f} | {gbytes / ms:.2f} | {torch.equal(got, expected)} |", flush=True)


if __name__ == "__main__":
    main()
