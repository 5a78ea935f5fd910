"""The local experts of one expert-parallel MoE layer on one GPU, eager against compiled: what
``fsdp8.parallel.ep.local_experts`` costs a forward + backward (the rows that arrived from the
dispatch regrouped by local expert, both grouped GEMMs with their SwiGLU, the rows put back),
and how long the host takes to issue it; and the same compiled on its own, its row count dynamic (it
changes every call, as the dispatch's does). Units compiled by ``parallelize`` run it eagerly,
between the two all-to-alls, outside their graphs.

    python3 benchmarks/debug/ep_local_experts.py [--rows 32768 --experts 32 --hidden 2048 --width 768]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp8.fp8 import grouped_kernel  # noqa: E402
from fsdp8.fp8.recipes import Float8CurrentScaling  # noqa: E402
from fsdp8.parallel.ep import local_experts  # noqa: E402


def problem(rows: int, experts: int, hidden: int, width: int, sources: int, seed: int):
    """Rows that arrived source-rank-major from ``sources`` ranks, about ``rows`` of them, uneven."""
    g = torch.Generator().manual_seed(seed)
    received = torch.multinomial(torch.ones(sources * experts), rows, replacement=True, generator=g)
    received = torch.bincount(received, minlength=sources * experts).view(sources, experts)
    arrived = torch.randn(int(received.sum()), hidden, generator=g).cuda().to(torch.bfloat16)
    return arrived.requires_grad_(), received.cuda()


def weights(experts: int, hidden: int, width: int):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=g) * hidden ** -0.5).cuda().to(torch.bfloat16)
    down = (torch.randn(experts, hidden, width, generator=g) * width ** -0.5).cuda().to(torch.bfloat16)
    return gate_up.requires_grad_(), down.requires_grad_()


def step(fn, arrived, received, gate_up, down, recipe):
    out = fn(arrived, received, gate_up, down, F.silu, recipe)
    out.backward(torch.ones_like(out))
    return out


def measure(fn, args, recipe, reps: int):
    """(wall ms per call, host ms per call): wall over ``reps`` calls then one sync; host: the
    time to issue them."""
    arrived_list, received_list, gate_up, down = args
    for i in range(3):
        step(fn, arrived_list[i % len(arrived_list)], received_list[i % len(arrived_list)], gate_up, down, recipe)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(reps):
        step(fn, arrived_list[i % len(arrived_list)], received_list[i % len(arrived_list)], gate_up, down, recipe)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return (end - start) * 1e3 / reps, (issued - start) * 1e3 / reps


def host_profile(args, reps: int, dump: str = "") -> None:
    import cProfile
    import pstats

    recipe = Float8CurrentScaling(fp8_format="e4m3")
    measure(local_experts, args, recipe, 3)
    profiler = cProfile.Profile()
    profiler.enable()
    measure(local_experts, args, recipe, reps)
    profiler.disable()
    if dump:
        profiler.dump_stats(dump)
    stats = pstats.Stats(profiler)
    print(f"per call: {stats.total_tt * 1e3 / reps:.2f} ms of profiled host time over {reps} calls")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)


def dynamic_rows(compiled):
    """``compiled`` called with the rows' count marked dynamic."""
    def call(arrived, *rest):
        torch._dynamo.maybe_mark_dynamic(arrived, 0)
        return compiled(arrived, *rest)
    return call


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--sources", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--host-profile", action="store_true", help="cProfile the eager FP8 calls: where the host goes")
    p.add_argument("--dump", default="", help="with --host-profile: write the pstats to this file")
    a = p.parse_args()
    print("kernel_runs:", grouped_kernel.kernel_runs(torch.device("cuda")))
    problems = [problem(a.rows + 97 * i, a.experts, a.hidden, a.width, a.sources, i) for i in range(4)]
    args = ([x for x, _ in problems], [r for _, r in problems], *weights(a.experts, a.hidden, a.width))
    if a.host_profile:
        host_profile(args, a.reps, a.dump)
        return
    compiled = torch.compile(local_experts)
    print(f"local experts: {a.experts} of [{2 * a.width}, {a.hidden}] and [{a.hidden}, {a.width}], about "
          f"{a.rows} rows from {a.sources} ranks, forward + backward")
    print("| recipe | eager ms (host ms) | compiled ms (host ms) | compiled vs eager: max |out diff| / max |out| |")
    print("|---|---:|---:|---:|")
    for name, recipe in (("bf16", None), ("FP8 current e4m3", Float8CurrentScaling(fp8_format="e4m3"))):
        x, r, gate_up, down = args[0][0], args[1][0], args[2], args[3]
        want = local_experts(x, r, gate_up, down, F.silu, recipe)
        got = dynamic_rows(compiled)(x, r, gate_up, down, F.silu, recipe)
        diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        eager = measure(local_experts, args, recipe, a.reps)
        comp = measure(dynamic_rows(compiled), args, recipe, a.reps)
        print(f"| {name} | {eager[0]:.2f} ({eager[1]:.2f}) | {comp[0]:.2f} ({comp[1]:.2f}) | {diff:.2e} |")
    from torch._dynamo.utils import counters
    print("graphs compiled:", counters["stats"]["unique_graphs"], "graph breaks:", dict(counters["graph_break"]))


if __name__ == "__main__":
    main()
