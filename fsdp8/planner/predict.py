"""fsdp8.plan(): predict a configuration's memory per rank, communication and step time on a cluster.

The pieces: ``model.py`` (the model's sizes and each unit's parameters), ``setup.py`` (the
configuration asked about), ``memory.py`` (persistent memory exactly as ``memory_report()``
counts it, the peak by formula), ``activations.py`` (what a layer keeps for backward),
``compute.py`` (the compute roofline), ``time.py`` (collectives, the overlap schedule, the
step), ``hardware.py`` (GPUs, cluster, efficiencies), ``candidates.py`` (``search``: the
configurations that fit, fastest first). docs/PLANNING.md writes the model out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Union

from ..config import ParallelConfig
from ..engine.sharded import MemoryReport
from .hardware import GIB, GPU, Cluster, Efficiency, describe_gpu, gpu_named
from .activations import layer_activations
from .memory import Peak, memory_report, optimizer_bytes, peaks, unit_plans
from .model import ModelSpec, converts_to_fp8, model_spec
from .setup import Setup, layout_fields, make_setup
from .time import StepTime, step_time

@dataclass(frozen=True)
class Memory:
    """Bytes per rank: ``report`` (exact, what memory_report() says), the optimizer's state,
    the peak moment's breakdown, and what the caching allocator and the runtime add."""

    report: MemoryReport
    optimizer: int
    peak: Peak
    allocator: float
    runtime: float
    capacity: int

    @property
    def allocated(self) -> float:
        return self.peak.total

    @property
    def total(self) -> float:
        return self.allocated + self.allocator + self.runtime

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class Plan:
    """A configuration's predicted memory, communication and speed (``str(plan)`` is the table)."""

    spec: ModelSpec
    setup: Setup
    memory: Memory
    time: StepTime

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.setup.global_batch * self.setup.seq_len / (self.time.step * self.setup.cluster.world)

    @property
    def mfu(self) -> float:
        """Model FLOPs (ModelSpec.flops_per_token) per second over the GPU's dense bf16 peak."""
        flops = self.spec.flops_per_token(self.setup.seq_len) * self.tokens_per_s_per_gpu
        return flops / (self.setup.cluster.gpu.bf16_tflops * 1e12)

    def to_dict(self) -> dict:
        m, t, s = self.memory, self.time, self.setup
        return {
            "model": dict(dataclasses.asdict(self.spec), params=self.spec.num_params,
                          active_params=self.spec.num_active_params),
            "setup": {"seq_len": s.seq_len, "micro_batch": s.micro_batch, "global_batch": s.global_batch,
                      **layout_fields(s.parallel, s.precision), "dp_shard": s.parallel.dp_shard,
                      "accumulation": s.accumulation},
            "cluster": dataclasses.asdict(self.setup.cluster),
            "efficiency": dataclasses.asdict(self.setup.efficiency),
            "memory": {"report": dataclasses.asdict(m.report), "host": m.report.host, "optimizer": m.optimizer,
                       "peak_moment": m.peak.moment, "peak_parts": m.peak.parts, "peak_allocated": m.allocated,
                       "allocator": m.allocator, "runtime": m.runtime, "total": m.total, "capacity": m.capacity,
                       "fits": m.fits},
            "communication": [{"what": c.what, "op": c.op, "group": c.group.name, "ranks": c.group.size,
                               "link": c.group.link, "calls": c.calls, "bytes": c.nbytes, "seconds": c.seconds,
                               "overlapped": c.overlapped} for c in t.collectives],
            "time": {"compute": t.compute, "compute_forward": t.compute_fwd, "host": t.host, "host_forward": t.host_fwd,
                     "host_measured": self.setup.efficiency.host is not None, "model_parallel": t.model_parallel,
                     "exposed": t.exposed, "optimizer": t.optimizer, "host_syncs": t.syncs, "step": t.step},
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
        }

    def __str__(self) -> str:
        return "\n".join(_header(self) + _memory_lines(self) + _comm_lines(self) + _time_lines(self))


def plan_setup(spec: ModelSpec, setup: Setup) -> Plan:
    """The prediction for a checked Setup."""
    units = unit_plans(spec, setup)
    report = memory_report(spec, setup)
    params = spec.block_params() + spec.moe_block_params()
    fp8 = {p.name: converts_to_fp8(p, setup.fp8, setup.parallel.tp, 0) for p in params}
    peak = max(peaks(spec, setup, report, units, layer_activations(spec, setup, fp8)), key=lambda p: p.total)
    eff = setup.efficiency
    memory = Memory(report, optimizer_bytes(units), peak, peak.total * eff.allocator, eff.runtime_gib * GIB,
                    setup.cluster.gpu.memory_bytes)
    return Plan(spec, setup, memory, step_time(spec, setup, units))


def plan(model: Union[str, ModelSpec, None] = None, parallel: Optional[ParallelConfig] = None, *,
         gpu: Union[str, GPU] = "h100", nodes: int = 1, gpus_per_node: int = 8, seq_len: int = 2048,
         micro_batch: int = 1, global_batch: Optional[int] = None, efficiency: Optional[Efficiency] = None,
         **sizes) -> Plan:
    """Predict memory per rank, communication and step time of training ``model`` laid out as
    ``parallel`` (a ``fsdp8.ParallelConfig``; default ``ParallelConfig()``) on ``nodes`` x
    ``gpus_per_node`` GPUs.

    ``model``: a built-in preset name, ``"hf:DIR"`` (a Hugging Face config.json), a ModelSpec,
    or None with every size given; ``sizes`` (layers, hidden, ffn, heads, kv_heads, vocab, tied)
    override the model's. ``parallel``: its inferred mesh size (``dp_shard=-1`` by default)
    takes what the GPUs leave, ``precision=None`` is what parallelize picks on GPUs (bf16), and
    its FP8 recipe is one of fsdp8's four (the planner knows each by name). ``gpu``: a name of
    ``fsdp8.planner.hardware.GPUS`` or a GPU. ``micro_batch``: sequences per data-parallel rank
    per micro-batch; ``global_batch``: sequences per step (default: one micro-batch per rank, no
    accumulation). Raises ValueError for a configuration that cannot run."""
    spec = model_spec(model, **sizes)
    cluster = Cluster(gpu if isinstance(gpu, GPU) else gpu_named(gpu), nodes, gpus_per_node)
    setup = make_setup(spec, cluster, parallel, seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                       efficiency=efficiency)
    return plan_setup(spec, setup)


def _header(p: Plan) -> List[str]:
    s = p.setup
    return [f"fsdp8 plan: {p.spec.describe()}",
            f"  on {s.cluster.describe()} = {s.cluster.world} GPUs ({describe_gpu(s.cluster.gpu)})",
            f"  seq {s.seq_len}, global batch {s.global_batch} = micro batch {s.micro_batch} x {s.dp} data-parallel "
            f"ranks x {s.accumulation} accumulation step{'s' * (s.accumulation > 1)}",
            f"  {s.describe()}", ""]


def _row(label: str, value: float) -> str:
    return f"  {label:<46}{value / GIB:10.2f}"


def _memory_lines(p: Plan) -> List[str]:
    m, r = p.memory, p.memory.report
    where = " (on the host)" if r.offloaded else ""
    eff = p.setup.efficiency
    verdict = "fits" if m.fits else f"does not fit: {(m.total - m.capacity) / GIB:.2f} GiB short"
    return [
        f"{'memory per rank':<48}{'GiB':>10}",
        "  persistent, exact (what memory_report() says):",
        _row(f"  main weights (fp32){where}", r.main_weights),
        _row(f"  gradients (fp32, after backward){where}", r.grads),
        _row("  compute copies", r.compute_copies),
        _row("  gradient accumulation", r.grad_accumulation),
        _row(f"optimizer state (AdamW, 2 x fp32){where}", m.optimizer),
        f"  at the peak ({m.peak.moment}):",
        *[_row(f"  {name}", value) for name, value in m.peak.parts.items() if value],
        _row("peak allocated", m.allocated),
        _row(f"allocator reserve ({eff.allocator:.0%} of the peak)", m.allocator),
        _row("CUDA runtime, outside torch's allocator", m.runtime),
        _row("total", m.total) + f"  of {m.capacity / GIB:.1f}: {verdict}",
        "",
    ]


def _comm_lines(p: Plan) -> List[str]:
    lines = [f"communication per step{'':<26}{'group':<18}{'link':<9}{'calls':>6}{'MiB/call':>11}{'ms':>10}"]
    for c in sorted(p.time.collectives, key=lambda c: -c.seconds):
        group = f"{c.group.name} ({c.group.size})"
        lines.append(f"  {c.what:<46}{group:<18}{c.group.link:<9}{c.calls:>6}{c.nbytes / 2**20:>11.2f}"
                     f"{c.seconds * 1e3:>10.2f}")
    if not p.time.collectives:
        lines.append("  none (one data-parallel rank, no tensor or context parallelism)")
    tokens = [c for c in p.time.collectives if c.op == "all_to_all"]
    if tokens:  # expert parallelism: each call sends (ep - 1)/ep of its buffer away
        sent = sum(c.calls * c.nbytes * (c.group.size - 1) / c.group.size for c in tokens)
        lines.append(f"  expert-parallel all-to-all: {sent / GIB:.2f} GiB sent per rank and step, "
                     f"{p.time.syncs * 1e3:.1f} ms of host synchronisations")
    return lines + [""]


def _time_lines(p: Plan) -> List[str]:
    t, eff, gpu = p.time, p.setup.efficiency, p.setup.cluster.gpu
    ms = lambda label, seconds: f"  {label:<46}{seconds * 1e3:10.1f}"  # noqa: E731
    return [
        f"{'step time':<48}{'ms':>10}",
        f"  compute: GEMMs at {eff.gemm:.0%} of {gpu.bf16_tflops:g} TFLOP/s (FP8 {eff.fp8_gemm:.0%} of "
        f"{gpu.fp8_tflops:g}), attention at {eff.attention:.0%},",
        ms(f"  other kernels at {eff.hbm:.0%} of {gpu.hbm_gbps:g} GB/s", t.compute),
        ms("TP/CP/EP collectives (compute stream)", t.model_parallel),
        ms(f"host issuing the kernels ({'measured here' if eff.host else 'per-op model'})", t.host),
        ms("forward + backward: each pass the slower of the two", t.issue_bound),
        *([ms(f"host synchronisations ({p.setup.efficiency.host_sync_us:g} us each)", t.syncs)] if t.syncs else []),
        ms("data-parallel communication left exposed", t.exposed),
        ms("optimizer step" + (" (on the host)" if p.setup.parallel.offload else ""), t.optimizer),
        ms("step", t.step),
        f"tokens/s/GPU {p.tokens_per_s_per_gpu:,.0f}   MFU {p.mfu:.1%}   "
        f"({'fits' if p.memory.fits else 'does NOT fit'} in {p.memory.capacity / GIB:.1f} GiB)",
    ]
