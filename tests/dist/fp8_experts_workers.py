"""FP8 expert weights gathered as 8-bit bytes, on every rank: functions run by
tests/dist/test_fp8_experts.py (module level, so workers import them).

Each run trains the built-in ``moe-tiny`` Llama (2 of its 4 layers) twice from the same
weights and batches: as the engine shards it now (the experts' 3-D weights quantized on the
ranks that hold them and gathered as bytes, fsdp8/engine/fp8_experts.py), and with the
experts' weights gathered in the compute dtype and quantized at every call, as before. The
same bytes and scales reach the same GEMMs, so every loss, gradient and weight is equal, bit
for bit.
"""

from __future__ import annotations

import copy
import math
from typing import Dict, List

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp8
from fsdp8.engine import model as engine_model
from fsdp8.fp8.recipes import recipe_from_name

from . import common

STEPS, ROWS_PER_RANK, SEQ, LR = 2, 2, 16, 0.1
PRECISION = fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build() -> nn.Module:
    from fsdp8.models.llama import Llama, preset

    torch.manual_seed(0)
    return Llama(preset("moe-tiny", n_layers=2)).to(common.device())


def parallelized(model: nn.Module, layout: dict, recipe_name: str, experts_in_8_bits: bool) -> nn.Module:
    """``model`` parallelized; ``experts_in_8_bits=False``: expert weights travel in the compute
    dtype (the engine is told no slot is an FP8 expert weight)."""
    config = fsdp8.ParallelConfig(**layout, fp8=recipe_from_name(recipe_name), precision=PRECISION)
    original = engine_model.gathers_fp8_expert
    if not experts_in_8_bits:
        engine_model.gathers_fp8_expert = lambda slot, recipe: False
    try:
        return fsdp8.parallelize(model, config)
    finally:
        engine_model.gathers_fp8_expert = original


def _expert_slots(model: nn.Module):
    """(unit, slot) of every expert weight."""
    return [(u, s) for u in model._fsdp8.units for s in u.slots if s.fqn.endswith(("gate_up_proj", "down_proj"))]


def _train(model: nn.Module) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out: dict = {"loss": [], "grads": [], "gathered": []}
    for step in range(STEPS):
        x, y = common.global_batch(step, ROWS_PER_RANK * model.dp_size, SEQ, model.config.vocab_size)
        batch = model.shard_batch({"tokens": x, "targets": y})
        with common.CountGathers() as gathered:
            loss = model(**{k: v.to(common.device()) for k, v in batch.items()})
            loss.backward()
        out["gathered"].append(gathered.bytes_by_label)
        out["loss"].append(loss.detach().float().cpu())
        out["grads"].append({n: common.full_tensor(p.grad).detach().float().cpu() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: common.full_tensor(p).detach().float().cpu() for n, p in model.named_parameters()}
    return out


def _differences(new: dict, old: dict) -> List[str]:
    wrong = [f"loss {i}" for i, (a, b) in enumerate(zip(new["loss"], old["loss"])) if not torch.equal(a, b)]
    for i, (a, b) in enumerate(zip(new["grads"], old["grads"])):
        wrong += [f"grad {i} {n}" for n in a if not torch.equal(a[n], b[n])]
    return wrong + [f"weight {n}" for n in new["weights"] if not torch.equal(new["weights"][n], old["weights"][n])]


def wire_parity(recipe_name: str, layout: dict) -> dict:
    """Train both ways (module doc): what differs, what the experts compute with, and the bytes
    each unit's gathers moved in the first step."""
    initial = build()
    old = parallelized(copy.deepcopy(initial), layout, recipe_name, experts_in_8_bits=False)
    new = parallelized(initial, layout, recipe_name, experts_in_8_bits=True)
    kinds = set()

    def record(module, args):
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name)
            kinds.add(type(weight._local_tensor if isinstance(weight, DTensor) else weight).__name__)

    experts = [m for n, m in new.named_modules() if n.endswith("experts")]
    hooks = [m.register_forward_pre_hook(record) for m in experts]
    old_run, new_run = _train(old), _train(new)
    for hook in hooks:
        hook.remove()
    experts_numel: Dict[str, int] = {}
    e8m0: Dict[str, int] = {}  # MX: the scale bytes that travel with the experts' bytes
    for unit, slot in _expert_slots(new):
        experts_numel[unit.name] = experts_numel.get(unit.name, 0) + slot.layout.numel
        *rows, cols = slot.layout.shape
        mx = recipe_name == "fp8-mxfp8"
        e8m0[unit.name] = e8m0.get(unit.name, 0) + (math.prod(rows) * math.ceil(cols / 32) if mx else 0)
    # What each unit's gathered parameters take (a one-chunk unit packs them without a gather).
    held = {u.name: (v.unsharded_nbytes, u.unsharded_nbytes) for u, v in zip(new._fsdp8.units, old._fsdp8.units)}
    return {"differences": _differences(new_run, old_run), "kinds": sorted(kinds), "experts": len(experts),
            "old_gathered": old_run["gathered"][0], "new_gathered": new_run["gathered"][0], "held": held,
            "experts_numel": experts_numel, "e8m0": e8m0, "chunks": {u.name: u.layout.num_chunks for u in new._fsdp8.units},
            "converted": sorted(n for n, m in new.named_modules() if getattr(m, "fp8_recipe", None) is not None)}


def compiled_parity(layout: dict) -> dict:
    """The built-in moe-tiny Llama under FP8 current scaling with e4m3 gradients, its units compiled
    (``aot_eager``: the graphs run the traced ops as they are, so any difference is the experts'),
    the grouped kernel's path forced (its CPU emulation): once with the experts traced into the
    units' graphs (grouped_traced.py), once as the opaque calls they were. Returns what differs
    and each run's graph breaks."""
    from torch._dynamo.utils import counters

    from fsdp8.fp8 import grouped, grouped_kernel
    from fsdp8.fp8.recipes import Float8CurrentScaling

    grouped_kernel.kernel_runs = lambda device: True  # this worker process only
    traced = grouped.traced_fp8_grouped_mm
    runs, breaks = [], []
    for trace in (True, False):
        torch._dynamo.reset()
        counters.clear()
        grouped.traced_fp8_grouped_mm = traced if trace else (
            lambda x, w, offs: grouped._opaque_grouped_mm(x, w, offs, Float8CurrentScaling(fp8_format="e4m3"), None))
        config = fsdp8.ParallelConfig(**layout, fp8=Float8CurrentScaling(fp8_format="e4m3"), precision=PRECISION,
                                      compile={"backend": "aot_eager"})
        runs.append(_train(fsdp8.parallelize(build(), config)))
        breaks.append(sum(counters["graph_break"].values()))
    grouped.traced_fp8_grouped_mm = traced
    return {"differences": _differences(*runs), "breaks": breaks}


def delayed_compiled_parity(layout: dict) -> dict:
    """The built-in moe-tiny Llama under delayed scaling, its units compiled (``aot_eager``) and
    eager: the dense linears traced with the engine's states, the experts an opaque call reading and
    recording theirs. Returns what differs (losses, gradients, weights) and the experts' histories."""
    from fsdp8.fp8.grouped_delayed import all_delayed_experts
    from fsdp8.fp8.recipes import DelayedScaling

    runs, histories = [], []
    for compiled in (True, False):
        torch._dynamo.reset()
        config = fsdp8.ParallelConfig(**layout, fp8=DelayedScaling(amax_history_len=4), precision=PRECISION,
                                      compile={"backend": "aot_eager"} if compiled else False)
        model = fsdp8.parallelize(build(), config)
        runs.append(_train(model))
        histories.append([e.history.cpu().clone() for e in all_delayed_experts(model)])
    same = [torch.equal(a, b) for a, b in zip(*histories)]
    moved = all(h[:, :, :STEPS - 1].gt(0).any().item() for h in histories[0])
    return {"differences": _differences(*runs), "histories_equal": same, "moved": moved}


def delayed_meta_init() -> dict:
    """moe-tiny built on the meta device, parallelized under delayed scaling: the experts' histories
    start as a fresh state's (zeros, scales 1) on the real device, not as the uninitialized memory
    materialization gives meta buffers; then two steps train and move them."""
    from fsdp8.fp8.grouped_delayed import all_delayed_experts
    from fsdp8.fp8.recipes import DelayedScaling

    from fsdp8.models.llama import Llama, preset

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(preset("moe-tiny", n_layers=2))
    model = fsdp8.parallelize(model, fsdp8.ParallelConfig(fp8=DelayedScaling(amax_history_len=4), precision=PRECISION))
    experts = all_delayed_experts(model)
    fresh = all(e.history.eq(0).all().item() and e.scale.eq(1).all().item() and not e.scale.is_meta for e in experts)
    run = _train(model)
    model._fsdp8.scales.refresh()
    moved = all(e.history[:, :, :STEPS].gt(0).any().item() and e.history.lt(1e6).all().item() for e in experts)
    return {"experts": len(experts), "fresh": fresh, "moved": moved,
            "losses": [float(x) for x in run["loss"]]}


def amax_all_reduces(layout: dict) -> dict:
    """All-reduces in one training step (after a first one) of moe-tiny under current and under
    delayed scaling: the experts' histories add none (they ride the step's one all-reduce)."""
    from fsdp8.fp8.recipes import DelayedScaling, Float8CurrentScaling

    from .workers import CountCollectives

    counts = {}
    for name, recipe in (("current", Float8CurrentScaling()), ("delayed", DelayedScaling(amax_history_len=4))):
        model = fsdp8.parallelize(build(), fsdp8.ParallelConfig(**layout, fp8=recipe, precision=PRECISION))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(2):
            x, y = common.global_batch(step, ROWS_PER_RANK * model.dp_size, SEQ, model.config.vocab_size)
            batch = model.shard_batch({"tokens": x, "targets": y})
            with CountCollectives() as counter:
                model(**{k: v.to(common.device()) for k, v in batch.items()}).backward()
                opt.step()
                opt.zero_grad()
        counts[name] = counter.counts.get("all_reduce", 0)
    return counts

