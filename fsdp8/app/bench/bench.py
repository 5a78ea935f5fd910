"""fsdp8 bench: train a configuration for a few steps on this machine and set the measurements beside
the planner's prediction."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, replace
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ...distributed.comm import all_gather_single_fn
from ...distributed.process_group import current_device, init_distributed
from ...planner.hardware import GIB, GPU, Cluster, Efficiency
from ...planner.predict import Plan, plan_setup
from .config import BenchConfig, cluster_here
from .host import measure_host
from .run import run_steps, trainer
from .step_profile import category, union_length


# -- the CPU as the planner's hardware ------------------------------------------------------------
CPU_EFFICIENCY = Efficiency(gemm=1.0, fp8_gemm=1.0, attention=0.5, hbm=1.0, link=1.0, latency_us=200.0,
                            allocator=0.0, runtime_gib=0.0)


def _rate(fn, work: float, repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return work * repeat / (time.perf_counter() - start)


def measure_cpu(world: int) -> GPU:
    """This CPU's rates as a GPU of the planner (measured in a fraction of a second, on every
    rank: the gloo bandwidth is a collective): fp32 GEMMs, copy bandwidth, gloo all-gather."""
    a = torch.randn(256, 256)
    flops = _rate(lambda: a @ a, 2 * 256 ** 3, repeat=20)
    x, y = torch.empty(2 ** 22), torch.empty(2 ** 22)
    copy = _rate(lambda: y.copy_(x), 2 * x.nbytes)
    send = torch.zeros(2 ** 18)
    out = torch.empty(world * send.numel())
    gather = all_gather_single_fn()
    link = _rate(lambda: gather(out, send), (world - 1) * send.nbytes) if world > 1 else copy
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, world)
    gbps = lambda r: r / 1e9  # noqa: E731
    return GPU("cpu (measured)", ram / GIB, flops / 1e12, flops / 4e12, flops / 1e12, gbps(copy), gbps(link),
               gbps(link), gbps(copy), gbps(copy))


# -- measuring -------------------------------------------------------------------------------------
_DP_COLLECTIVES = ("fsdp8::all_gather", "fsdp8::reduce_scatter", "fsdp8::all_reduce")


def exposed_seconds(events, cuda: bool) -> float:
    """Communication with no computation beside it, in a profiled step. On GPUs: time in which
    an NCCL kernel runs and no other kernel does. On CPUs (gloo waits synchronously): the time
    inside fsdp8's collectives."""
    if not cuda:
        return sum(e.time_range.elapsed_us() for e in events if e.name.startswith(_DP_COLLECTIVES)) / 1e6
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = union_length((e.time_range.start, e.time_range.end) for e in kernels)
    work = union_length((e.time_range.start, e.time_range.end) for e in kernels if category(e.name) != "comm")
    return (busy - work) / 1e6  # the time only NCCL kernels run, as step_profile.summarize counts it


def without_network(cluster: Cluster, efficiency: Efficiency) -> Tuple[Cluster, Efficiency]:
    """The same machine with communication of infinite speed and no latency: what the planner
    predicts for a run whose collectives are local copies (loopback.py)."""
    infinite = 1e12  # GB/s
    gpu = replace(cluster.gpu, nvlink_gbps=infinite, network_gbps=infinite)
    return replace(cluster, gpu=gpu), replace(efficiency, latency_us=0.0)


def bench(cfg: BenchConfig, network: bool = True) -> Optional[dict]:
    """Run on every rank (spawned by fsdp8.app.launch or under torchrun); rank 0 prints the result
    (a table, or JSON with ``cfg.json``) and returns it. ``network=False``: the collectives
    are known to cost nothing (a loopback world on one GPU), so the prediction leaves them out."""
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    measured_cpu = None if cuda else measure_cpu(world)
    spec = cfg.spec()
    cluster, efficiency = cluster_here(world, cfg.gpu, measured_cpu), Efficiency() if cuda else CPU_EFFICIENCY
    if not network:
        cluster, efficiency = without_network(cluster, efficiency)
    probe_times: List[list] = []
    if cfg.host_probe:
        host, probe_times = measure_host(cfg, spec, device)
        efficiency = replace(efficiency, host=host)
    setup = cfg.setup(spec, cluster, efficiency)
    step = trainer(cfg, spec, device)
    times = [total for _, total in run_steps(step, cfg.warmup, cfg.steps, after_warmup=torch.cuda.reset_peak_memory_stats
                                             if cuda else None)]
    peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
    from torch.profiler import ProfilerActivity, profile

    # Kineto, the profiler's backend, prints "USDT: ... profiler_start" and "profiler_stop" to
    # stderr around every profile: it keeps its log to errors unless told otherwise, but those
    # markers have a level above ERROR. Only a level above theirs (6) hides them; kineto reads
    # it when the process's first profile starts. A KINETO_LOG_LEVEL of the user's stands.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(cfg.warmup + cfg.steps)
    exposed = exposed_seconds(prof.events(), cuda)
    worst = torch.tensor([statistics.median(times), peak, exposed], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rank != 0:
        return None
    # Beside it, what the planner's fixed per-op host costs would have said.
    per_op = plan_setup(spec, replace(setup, efficiency=replace(efficiency, host=None))) if cfg.host_probe else None
    result = report(cfg, plan_setup(spec, setup), *worst.tolist(), cuda=cuda, per_op_model=per_op)
    # Rank 0's own times, to see how steady this host is: each timed step, each probe's steps.
    result["steps_ms"] = [t * 1e3 for t in times]
    if result["host"] is not None:
        result["host"]["probe_steps_ms"] = [[(f * 1e3, total * 1e3) for f, total in depth] for depth in probe_times]
    print(json.dumps(result, indent=2) if cfg.json else format_result(result), flush=True)
    return result


def report(cfg: BenchConfig, predicted: Plan, step_s: float, peak: float, exposed: float, cuda: bool,
           per_op_model: Optional[Plan] = None) -> dict:
    """Measurements, predictions and their ratios (None where nothing was measured); with the
    host probe, the probe's figures and the step the per-op host model predicts."""
    s = predicted.setup
    tokens = s.global_batch * s.seq_len / (step_s * s.cluster.world)
    mfu = predicted.spec.flops_per_token(s.seq_len) * tokens / (s.cluster.gpu.bf16_tflops * 1e12)
    measured = {"tokens_per_s_per_gpu": tokens, "step_ms": step_s * 1e3, "mfu": mfu,
                "peak_allocated_gib": peak / GIB if cuda else None, "exposed_comm_ms": exposed * 1e3}
    t = predicted.time
    expected = {"tokens_per_s_per_gpu": predicted.tokens_per_s_per_gpu, "step_ms": t.step * 1e3, "mfu": predicted.mfu,
                "peak_allocated_gib": predicted.memory.allocated / GIB,
                # What the measurement can see: data-parallel collectives left exposed, and on GPUs
                # (every NCCL kernel) the tensor-parallel ones too.
                "exposed_comm_ms": (t.exposed + (t.model_parallel if cuda else 0.0)) * 1e3}
    # No ratio to a prediction of (about) nothing: a loopback world's free communication.
    ratio = {k: (measured[k] / expected[k] if measured[k] is not None and expected[k] > 1e-6 else None)
             for k in measured}
    return {"config": cfg.to_dict(), "model": predicted.spec.describe(),
            "setup": s.describe(), "world": s.cluster.world, "hardware": s.cluster.gpu.name,
            "device": "cuda" if cuda else "cpu", "measured": measured, "predicted": expected, "ratio": ratio,
            "plan": predicted.to_dict(), "host": _host_summary(predicted, per_op_model, step_s)}


def _host_summary(predicted: Plan, per_op_model: Optional[Plan], step_s: float) -> Optional[dict]:
    host = predicted.setup.efficiency.host
    if host is None:
        return None
    ms = {k: v * 1e3 for k, v in asdict(host).items()}
    return {"probe_ms": ms, "step_host_ms": predicted.time.host * 1e3,
            "per_op_model_step_ms": per_op_model.time.step * 1e3,
            "per_op_model_ratio": step_s / per_op_model.time.step}


def format_result(r: dict) -> str:
    c = r["config"]
    rows = [("tokens/s/GPU", "tokens_per_s_per_gpu", "{:,.0f}"), ("step ms", "step_ms", "{:.1f}"),
            ("MFU", "mfu", "{:.1%}"), ("peak allocated GiB", "peak_allocated_gib", "{:.2f}"),
            ("exposed communication ms", "exposed_comm_ms", "{:.1f}")]
    lines = [f"fsdp8 bench: {r['model']}",
             f"  {r['world']} x {r['device']} ({r['hardware']}), seq {c['seq_len']}, micro batch {c['micro_batch']} x "
             f"{c['accumulation']}, {r['setup']}; {c['steps']} timed steps after {c['warmup']} warm-up",
             f"  {'':<26}{'measured':>12}{'predicted':>12}{'ratio':>8}"]
    for label, key, fmt in rows:
        m, p, q = r["measured"][key], r["predicted"][key], r["ratio"][key]
        lines.append(f"  {label:<26}{(fmt.format(m) if m is not None else 'n/a'):>12}{fmt.format(p):>12}"
                     f"{(f'{q:.2f}' if q is not None else 'n/a'):>8}")
    h = r.get("host")
    if h is not None:
        p = h["probe_ms"]
        lines.append(f"  host, measured here: {p['layer_fwd']:.2f} + {p['layer_bwd']:.2f} ms per layer (forward + "
                     f"backward), {p['root_fwd']:.2f} + {p['root_bwd']:.2f} ms root and step, {h['step_host_ms']:.1f} "
                     f"ms a step; with the per-op host model instead: {h['per_op_model_step_ms']:.1f} ms "
                     f"(ratio {h['per_op_model_ratio']:.2f})")
    if r["device"] == "cpu":
        lines.append("  (CPU: predicted from this CPU's measured GEMM, copy and gloo rates; peak memory is not "
                     "measured; exposed communication is the time inside fsdp8's collectives)")
    return "\n".join(lines)

