"""Experiment: the engine's host time per training step, measured on a CPU.

A 16-layer Llama so small (dim 64) that its arithmetic costs little, world 1 (gloo), eager:
the step time is then mostly Python and dispatch, the same work the host does for a GPU step.
Prints ms per step for the plain model, under ``fully_shard`` and under ``fully_shard`` with
FP8 current scaling, and (``--profile``) the engine's functions by cumulative time.

    PYTHONPATH=$PWD python benchmarks/debug/engine_host_time.py [--profile 'fully_shard'] [--steps 30]
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fsdp8  # noqa: E402
from fsdp8.models.llama import Llama, LlamaConfig  # noqa: E402


def step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(model, steps: int, profile: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randint(0, 128, (1, 16))
    y = torch.randint(0, 128, (1, 16))
    for _ in range(3):
        step(model, opt, x, y)
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(model, opt, x, y)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    if profiler:
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
        stats.print_stats(60)
        print(text.getvalue())
    return ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", default="", help="comma list of row names to run (all by default)")
    p.add_argument("--profile", default="", help="profile this row (its name), e.g. fully_shard")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    base = Llama(LlamaConfig(vocab_size=128, dim=64, n_layers=16, n_heads=4, n_kv_heads=2, ffn_dim=128,
                             max_seq_len=16))
    rows = [("plain model", lambda: copy.deepcopy(base)),
            ("fully_shard", lambda: fsdp8.fully_shard(copy.deepcopy(base))),
            ("fully_shard, FP8 current", lambda: fsdp8.fully_shard(copy.deepcopy(base),
                                                                   fp8=fsdp8.Float8CurrentScaling()))]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | ms per step |")
    print("|---|---:|")
    chosen = set(args.rows.split(",")) if args.rows else None
    for name, make in rows:
        if chosen is not None and name not in chosen:
            continue
        ms = timed(make(), args.steps, name == args.profile)
        print(f"| {name} | {ms:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
