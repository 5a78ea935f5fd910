"""ShardedModel: what a module is once fully_shard has sharded it (its class becomes
``Sharded<Class>``), the Engine it holds, and the per-rank MemoryReport; engines notice optimizer
steps through one global hook."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..config import Precision
from .fp8_scales import ScaleAgreement
from .schedule import Schedule
from .state_dict import load_sharded_state_dict
from .topology import Topology
from .unit import ShardedUnit


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank held by the engine, by kind."""

    strategy: str
    main_weights: int  # main-dtype chunks the optimizer updates
    grads: int  # optimizer-visible gradient chunks (present after a backward)
    compute_copies: int  # compute-dtype copies kept between steps
    grad_accumulation: int  # ZeRO-0/1 unsharded gradient accumulators
    largest_unsharded_unit: int  # transient: the biggest unit gathered for compute (ZeRO-3)
    offloaded: bool = False  # main weights and gradients (and so optimizer state) in host memory

    @property
    def persistent(self) -> int:
        """Device bytes kept between steps (host bytes when nothing is offloaded: the same memory)."""
        on_device = self.compute_copies + self.grad_accumulation
        return on_device if self.offloaded else on_device + self.main_weights + self.grads

    @property
    def host(self) -> int:
        """Host bytes of offloaded main weights and gradients (0 without offload)."""
        return self.main_weights + self.grads if self.offloaded else 0

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:10.2f} MiB"  # noqa: E731
        rows = [
            ("main weights", self.main_weights),
            ("gradients", self.grads),
            ("compute copies", self.compute_copies),
            ("grad accumulation", self.grad_accumulation),
            ("persistent on device" if self.offloaded else "persistent total", self.persistent),
            ("largest unsharded unit", self.largest_unsharded_unit),
        ]
        if self.offloaded:
            rows.insert(4, ("offloaded to host", self.host))
        return f"fsdp8 memory per rank ({self.strategy})\n" + "\n".join(f"  {k:<24}{mib(v)}" for k, v in rows)


class Engine:
    """Everything fully_shard built for one model."""

    def __init__(self, topology: Topology, precision: Precision, units: List[ShardedUnit], root_unit, schedule: Schedule,
                 own_topologies: Sequence[Topology] = ()):
        self.topology = topology  # the world mesh's; units on meshes of their own have theirs (model.py)
        self.topologies = [topology, *own_topologies]
        self.precision = precision
        self.units = units
        self.root_unit = root_unit
        self.schedule = schedule
        self.all_units = schedule.all_units
        self.scales: Optional[ScaleAgreement] = None
        self._unit_of_param = {id(s.main): u for u in self.all_units for s in u.slots}
        # Main weights that every tensor-parallel rank holds whole (norms, biases of rowwise layers).
        self.tp_replicated = {id(s.main) for u in self.all_units for s in u.slots if s.inner is not None and s.inner.is_replicated}

    def note_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark units whose main weights this optimizer may have changed as stale."""
        touched = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                unit = self._unit_of_param.get(id(p))
                if unit is not None:
                    touched.add(unit)
        for unit in touched:
            unit.mark_stale()


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_HOOK_INSTALLED = False


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    for engine in list(_ENGINES):
        engine.note_optimizer_step(optimizer)


def track(engine: Engine) -> None:
    """Let ``engine`` hear of every optimizer step from now on (while it lives)."""
    _ENGINES.add(engine)
    _install_optimizer_hook()


def _install_optimizer_hook() -> None:
    # A global post-step hook sees every torch.optim optimizer without wrapping it; fused
    # and foreach steps on DTensors do not bump version counters, so those alone miss steps.
    global _HOOK_INSTALLED
    if not _HOOK_INSTALLED:
        register_optimizer_step_post_hook(_on_optimizer_step)
        _HOOK_INSTALLED = True


class ShardedModel(nn.Module):
    """Mixin given to a module by ``fully_shard`` (its class becomes ``Sharded<Class>``)."""

    _fsdp8: Engine

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without the communication a synced backward does.

        ZeRO-0/1 keep gradients unsharded and reduce nothing; ZeRO-2/3 still
        reduce-scatter (gradients are sharded) but defer the HSDP cross-replica all-reduce."""
        schedule = self._fsdp8.schedule
        previous = schedule.sync_grads
        schedule.sync_grads = False
        try:
            yield
        finally:
            schedule.sync_grads = previous

    def memory_report(self) -> MemoryReport:
        engine = self._fsdp8
        units = engine.all_units
        main_elem = engine.precision.main_dtype.itemsize
        reduce_elem = engine.precision.grad_reduce_dtype.itemsize
        acc = 0
        if engine.topology.grads_unsharded:
            acc = sum(u.layout.num_chunks * u.layout.trainable_numel * reduce_elem for u in units)
        largest = 0
        if engine.topology.strategy.shards_params:
            largest = max((u.unsharded_nbytes for u in units if not u.aliased), default=0)
        return MemoryReport(
            strategy=engine.topology.strategy.label,
            main_weights=sum(u.layout.chunk_numel * main_elem for u in units),
            grads=sum(u.layout.trainable_numel * main_elem for u in units),
            compute_copies=sum(u.persistent_compute_bytes() for u in units),
            grad_accumulation=acc,
            largest_unsharded_unit=largest,
            offloaded=any(u.offload for u in units),
        )

    @contextlib.contextmanager
    def _main_registered(self):
        compute = [u for u in self._fsdp8.all_units if u.exposes_compute]
        for u in compute:
            u.register(compute=False)
        try:
            yield
        finally:
            for u in compute:
                u.register(compute=True)

    def state_dict(self, *args, **kwargs):
        """Original FQNs; parameters as main-dtype DTensors, buffers as plain tensors."""
        with self._main_registered():
            return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors or DTensors; missing, unexpected and mis-shaped keys are all listed."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the sharded parameters; use assign=False")
        with self._main_registered():
            expected = super().state_dict(keep_vars=True)
        return load_sharded_state_dict(self, self._fsdp8, expected, state_dict, strict)


_SHARDED_CLASSES: Dict[type, type] = {}


def sharded_class(cls: type) -> type:
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModel, cls), {})
    return _SHARDED_CLASSES[cls]
