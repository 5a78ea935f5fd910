"""Experiment: where the host's Python goes in a compiled tensor-parallel step, counted on a CPU.

A compiled FP8 + TP step on Hopper is host-bound (PERFORMANCE.md section 6): its GPU work is
shorter than the Python that issues it. Python's calls do not depend on the tensors' sizes, so a
tiny Hugging Face Llama on 2 gloo ranks makes the same calls per layer as model B on GPUs (less
the kernel launches, which the CPU's Inductor code makes as C++ calls). Rank 0 profiles
``--steps`` steps of ``fsdp8.parallelize(tp=2, sequence_parallel=True, compile=True)`` in bf16
and with FP8 current scaling, and prints the calls per step by source (fsdp8, DTensor, autograd,
Inductor's wrapper, ...) and the busiest functions.

    PYTHONPATH=$PWD python benchmarks/debug/tp_host_calls.py [--layers 4] [--steps 3] [--stacks bf16,fp8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SOURCES = [("fsdp8/engine", "fsdp8 engine"), ("fsdp8/fp8", "fsdp8 fp8"), ("fsdp8/", "fsdp8 other"),
           ("torch/distributed/tensor", "DTensor"), ("torch/distributed/_functional", "functional collectives"),
           ("torch/distributed", "torch.distributed other"), ("torch/autograd", "autograd"),
           ("torch/_inductor", "Inductor runtime"), ("torch/_dynamo", "Dynamo guards/runtime"),
           ("torch/_functorch", "AOT autograd runtime"), ("torch/nn", "torch.nn"),
           ("transformers/", "transformers"), ("/tmp/", "generated code"), ("torchinductor", "generated code"),
           ("torch/", "torch other"), ("~", "builtins")]


def source_of(filename: str) -> str:
    for needle, name in SOURCES:
        if needle in filename:
            return name
    return "other"


def build(stack: str, layers: int):
    import transformers

    import fsdp8

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    fp8 = fsdp8.Float8CurrentScaling() if stack == "fp8" else None
    layout = fsdp8.ParallelConfig(tp=2, sequence_parallel=True, compile=True, fp8=fp8)
    model = fsdp8.parallelize(model, layout)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batch = torch.randint(0, 128, (2, 32))
    for stack in args.stacks.split(","):
        model, opt = build(stack, args.layers)

        def step():
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):  # compile, then two steps more for the recompile-free state
            step()
        profiler = cProfile.Profile()
        dist.barrier()
        profiler.enable()
        for _ in range(args.steps):
            step()
        profiler.disable()
        if rank == 0:
            report(stack, profiler, args)
        dist.barrier()
    dist.destroy_process_group()


def report(stack: str, profiler: cProfile.Profile, args) -> None:
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(Path(args.dump) / f"{stack}.pstats"))
    stats = pstats.Stats(profiler)
    by_source, own_time = Counter(), Counter()
    for (filename, _, _), (_, calls, tottime, _, _) in stats.stats.items():
        by_source[source_of(filename)] += calls
        own_time[source_of(filename)] += tottime
    total = sum(by_source.values())
    print(f"\n## {stack}: {total / args.steps:,.0f} Python calls per step, {args.layers} layers, rank 0")
    print("| source | calls per step | own time share |")
    print("|---|---:|---:|")
    time_total = sum(own_time.values())
    for name, calls in by_source.most_common():
        print(f"| {name} | {calls / args.steps:,.0f} | {own_time[name] / time_total:.1%} |")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("ncalls").print_stats(args.top)
    print(text.getvalue()[-9000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stacks", default="bf16,fp8")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--dump", default="", help="folder for rank 0's pstats, one file per stack")
    args = p.parse_args()
    mp.spawn(worker, args=(2, 29571, args), nprocs=2)


if __name__ == "__main__":
    main()
