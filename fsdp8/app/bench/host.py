"""The host's share of a step, measured on this machine for the prediction ``fsdp8 bench`` prints.

Eager PyTorch issues kernels one by one, and a step whose kernels are short (small layers,
selective checkpointing's Python policy on every op, FP8's eager quantization) waits for the
host. How fast a host issues them differs from machine to machine: model A under selective
checkpointing took 201 ms on one H200 machine and 246 ms on another with the same code
(docs/PLANNING.md), which a fixed cost per op cannot follow. So bench measures it: the probe
trains the benchmarked configuration (architecture, heads, layout, world, precision, FP8
recipe, checkpointing, accumulation) with every tensor tiny, so that the device finishes each
kernel before the host issues the next and each pass takes the host's time. Two depths of
the model (half and all of its layers) separate one layer's cost from the root's and the step's.
"""

from __future__ import annotations

import gc
import math
import statistics
from dataclasses import replace
from typing import List, Tuple

import torch
import torch.distributed as dist

from ...planner.hardware import HostCost
from ...planner.model import ModelSpec
from .config import BenchConfig
from .run import StepTimes, run_steps, trainer

PROBE_BLOCK = 128  # every tensor-parallel piece a whole scaling block of every FP8 recipe


def probe_depths(layers: int) -> Tuple[int, int]:
    """The probe's two depths: half the model and the whole of it. The whole model's depth
    makes the probe's total for it a measurement, not an extrapolation (a line through two
    shallow points multiplies their noise by the model's depth)."""
    return (layers // 2, layers) if layers > 1 else (1, 2)


def probe_spec(spec: ModelSpec, layers: int, tp: int) -> ModelSpec:
    """``spec``'s architecture (heads, K/V heads, family, ties, biases) at ``layers`` layers with
    tiny widths: every linear dimension, and each rank's piece of it under tensor parallelism,
    a multiple of 128, so that FP8 converts every linear. A model no wider than that keeps its
    own widths (its linears may not all suit FP8). Left out: a wide model some of whose
    linears FP8 skips (pieces that cut a scaling block) probes with them converted."""
    unit = PROBE_BLOCK * tp
    head_dim = unit // math.gcd(spec.kv_heads, unit)  # K/V heads x head_dim: a multiple of unit
    while head_dim < 16:  # rotary halves it; SDPA's kernels want at least 8 per half
        head_dim *= 2
    # The fsdp8 Llama derives head_dim from hidden / heads: keep that so (a multiple of unit too).
    hidden, ffn = spec.heads * head_dim, 2 * unit
    name = f"{spec.name} (host probe)"
    if spec.hidden * spec.ffn <= hidden * ffn:
        return replace(spec, name=name, layers=layers, vocab=min(spec.vocab, 2 * unit))
    return replace(spec, name=name, layers=layers, hidden=hidden, ffn=ffn, vocab=2 * unit,
                   head_dim=head_dim if spec.family == "hf" else 0)


def probe_config(cfg: BenchConfig) -> BenchConfig:
    """``cfg`` on one sequence per micro-batch, as short as its layout allows."""
    return replace(cfg, micro_batch=1, seq_len=32 * cfg.parallel.cp * cfg.parallel.tp)


def fit_host_cost(shallow: Tuple[float, float], deep: Tuple[float, float], depths: Tuple[int, int],
                  accumulation: int) -> HostCost:
    """One layer's and the root's host seconds per micro-batch, from the (forward, backward)
    seconds of a step at two depths: per pass, a line through the two points. Backward's root
    share carries the step's own work (clipping, the optimizer's launches). The deep probe is
    the benchmarked model's own depth, so its total is kept exactly; noise that would make a
    share negative moves all of it to the other share."""
    (n1, n2), fitted = depths, []
    for a, b in ((shallow[0], deep[0]), (shallow[1], deep[1])):
        layer = (b - a) / (n2 - n1)
        root = b - n2 * layer
        if root < 0:
            layer, root = b / n2, 0.0
        elif layer < 0:
            layer, root = 0.0, b
        fitted.append((layer / accumulation, root / accumulation))
    (layer_fwd, root_fwd), (layer_bwd, root_bwd) = fitted
    return HostCost(layer_fwd=layer_fwd, layer_bwd=layer_bwd, root_fwd=root_fwd, root_bwd=root_bwd)


def _passes(times: List[StepTimes]) -> Tuple[float, float]:
    """The median step's forward and backward seconds (backward: all but forward)."""
    forward = statistics.median(f for f, _ in times)
    return forward, statistics.median(total for _, total in times) - forward


def measure_host(cfg: BenchConfig, spec: ModelSpec, device: torch.device,
                 steps: int = 10) -> Tuple[HostCost, List[List[StepTimes]]]:
    """This machine's HostCost for ``cfg`` (collective: every rank probes; the slowest host's
    figures are everyone's, as the slowest rank sets a step's pace), and this rank's step
    times at each depth."""
    small, depths = probe_config(cfg), probe_depths(spec.layers)
    times = [run_steps(trainer(small, probe_spec(spec, depth, cfg.parallel.tp), device), warmup=2, steps=steps)
             for depth in depths]
    cost = fit_host_cost(_passes(times[0]), _passes(times[1]), depths, cfg.accumulation)
    figures = torch.tensor([cost.layer_fwd, cost.layer_bwd, cost.root_fwd, cost.root_bwd], dtype=torch.float64,
                           device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if device.type == "cuda":
        gc.collect()  # the probe models' hooks hold them in reference cycles
        torch.cuda.empty_cache()  # the probe's blocks are not the benchmark's
    return HostCost(*figures.tolist()), times
