"""One rank's context-parallel attention (forward + backward) against full causal attention, on one device.

    python benchmarks/cp_attention.py                          # GPU: bf16, seq 8k-64k, cp 1 2 4 8
    python benchmarks/cp_attention.py --device cpu --seq 256   # CPU smoke run: fp32, tiny

A cp rank holds 2 of the 2cp chunks of every sequence (fsdp8/parallel/cp.py, [Note: head-tail
chunks]); its attention takes the cp group's all-gathered keys and values. Here the gathered
buffer is a leaf tensor, so the timing is everything a rank does in attention except the
all-gather and the reduce-scatter of the key/value gradients: reordering the gathered chunks,
repeating kv heads, SDPA per query chunk with a bottom-right causal mask, and their
backward. cp = 1 is the plain model's attention (repeat kv heads, SDPA is_causal) on the whole
sequence. On CUDA the SDPA calls are restricted to the flash and memory-efficient kernels, so
a fallback to a dense mask fails instead of being timed. Peak memory is what the pass
allocates on top of its inputs (CUDA only). Prints one row per (seq, cp): the first and the
last rank's time (equal work: the head-tail layout balances causal attention) and their
ratio to cp = 1.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp8.models.llama import causal_attention  # noqa: E402
from fsdp8.parallel import cp  # noqa: E402


def _inputs(args, seq: int, n: int, rank: int):
    """Leaf tensors of one rank: (q, gathered) for cp > 1, (q, k, v) of the whole sequence for cp = 1."""
    g = torch.Generator(device=args.device).manual_seed(rank)
    dtype = getattr(torch, args.dtype)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, device=args.device, dtype=dtype).requires_grad_()

    b, h, kv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    if n == 1:
        return leaf(b, h, seq, d), leaf(b, kv, seq, d), leaf(b, kv, seq, d)
    local = seq // n
    return leaf(b, h, local, d), leaf(n, 2 * b * kv * local * d)


def _step(args, n: int, rank: int, tensors) -> None:
    if n == 1:
        q, k, v = tensors
        out = causal_attention(q, k, v)
    else:
        q, gathered = tensors
        b, kv, local, d = args.batch, args.kv_heads, q.shape[2], args.head_dim
        shape = torch.Size((b, kv, local, d))
        half = gathered.shape[1] // 2
        k = cp._global_order(gathered[:, :half], shape, rank, n)
        v = cp._global_order(gathered[:, half:], shape, rank, n)
        out = cp.attend_chunks(q, k, v, rank, n)
    out.backward(torch.ones_like(out))


def _kernels(device: str):
    if device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def measure(args, seq: int, n: int, rank: int):
    """(median milliseconds of forward + backward, peak MiB above the inputs or None)."""
    cuda = args.device == "cuda"
    tensors = _inputs(args, seq, n, rank)
    times = []
    with _kernels(args.device):
        for i in range(args.warmup + args.iters):
            for t in tensors:
                t.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            _step(args, n, rank, tensors)
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    del tensors
    return sorted(times)[len(times) // 2] * 1e3, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, {args.dtype}, batch {args.batch}, heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}; "
          "one rank's attention forward + backward, no communication")
    print("| seq | cp | tokens/rank | first rank ms | last rank ms | x of cp 1 | peak MiB (first rank) |")
    print("|---|---|---|---|---|---|---|")
    for seq in args.seq:
        full = None
        for n in args.cp:
            if seq % (2 * n):
                print(f"| {seq} | {n} | - | skipped: seq not divisible by 2 x cp | | | |")
                continue
            first, peak = measure(args, seq, n, 0)
            last = measure(args, seq, n, n - 1)[0] if n > 1 else first
            full = first if n == 1 else full
            ratio = f"{max(first, last) / full:.3f}" if full else "-"
            mib = f"{peak:.0f}" if peak is not None else "-"
            print(f"| {seq} | {n} | {seq // n} | {first:.2f} | {last:.2f} | {ratio} | {mib} |", flush=True)


if __name__ == "__main__":
    main()
