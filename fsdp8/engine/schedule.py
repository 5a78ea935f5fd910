"""Forward/backward hooks: when each unit gathers, reshards and reduces, and in which order.

[Note: one iteration]
root pre-forward   gather the root unit, prefetch the first unit of the recorded order
unit pre-forward   gather (if not prefetched), prefetch the next unit, wait, expose params
unit post-forward  reshard (ZeRO-3; not the last unit of the recorded forward order, which
                   backward needs first), hook the outputs for pre-backward
unit pre-backward  (first output grad) gather again, prefetch the next unit backwards
unit post-backward (grad reached the unit's inputs) reduce gradients, reshard
end of backward    reduce what is left (root, units whose inputs need no grad), wait for
                   the reduce stream, reshard, give modules their main DTensors back

The prefetch order is the order recorded in the first iteration (backward: reverse of
forward until a backward has been recorded), so a model that runs its blocks in another
order than it defines them still overlaps. A wrong guess costs only an early gather.

[Note: the last unit stays gathered]
Backward starts with the unit forward ended with. Resharding it after forward would free
its parameters only to gather them again a moment later, with nothing but the head's
compute to hide that gather behind (FSDP2 leaves this to the user, who passes
``reshard_after_forward=False`` for the last block). So once the order is recorded, the last
unit of forward keeps its parameters until its post-backward. The root keeps its own for
the same reason. A forward that starts before the previous one's backward reshards both
first, so they are gathered afresh like every other unit: an optimizer step may have come
between (forward, step, forward) and must not leave them stale.

[Note: post-backward]
A unit's gradients are complete when autograd has produced the gradient of its inputs:
``_PostBackward`` wraps the inputs and fires then. AccumulateGrad nodes run before other
ready nodes (they have the highest sequence number), so by that time every parameter
gradient of the unit has been accumulated. A unit called twice expects two firings.
Anything a firing cannot see (inputs that need no grad, unused outputs) is handled at the
end of backward, so no gradient is ever dropped.

Recomputation under activation checkpointing calls the unit's forward during backward;
``in_backward()`` tells those calls apart, and they only make sure parameters are there.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from torch.profiler import record_function

from ..distributed import comm
from .unit import ShardedUnit
from .unit_grads import PendingReduce


class Phase(enum.Enum):
    IDLE = "idle"  # between iterations: modules hold main DTensors
    FORWARD = "forward"  # inside a root forward
    AWAIT_BACKWARD = "await_backward"  # forward done with autograd graph, backward not yet run
    BACKWARD = "backward"


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def tensors_in(obj: Any) -> List[torch.Tensor]:
    """Tensors inside nested tuples, lists, dicts and dataclass/HF-output objects."""
    found: List[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, f) for f in item.__dataclass_fields__)
    return found


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the unit's gradients complete."""

    @staticmethod
    def forward(ctx, schedule: "Schedule", unit: ShardedUnit, *inputs):
        ctx.schedule, ctx.unit = schedule, unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.schedule.post_backward(ctx.unit)
        return (None, None) + grads


class Schedule:
    """The per-iteration state machine shared by all units of one sharded model."""

    def __init__(self, root: nn.Module, root_unit: Optional[ShardedUnit], units: List[ShardedUnit], cast_dtype):
        self.root = root
        self.root_unit = root_unit
        self.units = units
        self.all_units = ([root_unit] if root_unit is not None else []) + units
        self.cast_dtype = cast_dtype
        self.phase = Phase.IDLE
        self.sync_grads = True
        self.forward_order: List[ShardedUnit] = []
        self.backward_order: List[ShardedUnit] = []
        self.order_frozen = False
        self.backward_recorded = False
        self._forward_calls: Dict[ShardedUnit, int] = {}
        self._expected_post: Dict[ShardedUnit, int] = {}
        self._reduced: set = set()
        self._backward_started: set = set()
        self._callback_queued = False
        self._pending: Optional[PendingReduce] = None
        self._kept: Optional[ShardedUnit] = None  # gathered through to backward ([Note: the last unit ...])
        self._streams = self.all_units[0].streams if self.all_units else None
        self._handles = []
        self._preflight = None  # set by the model: checks run before the first forward
        self.before_forward: List = []  # called at each root forward before any gather that needs them (FP8 scales)
        self.after_backward: List = []  # called at the end of each backward (finite checks)

    # -- installation ------------------------------------------------------------------
    def install(self) -> None:
        self._handles.append(self.root.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True))
        self._handles.append(self.root.register_forward_hook(self._root_post_forward))
        # A unit nested in another unit's compiled forward (an experts module inside its decoder
        # layer) has its hooks called from inside the graph: they run eagerly (a graph break),
        # since tracing them would recompile on the schedule's changing state.
        eager = torch.compiler.disable
        for unit in self.units:
            self._handles.append(
                unit.module.register_forward_pre_hook(
                    eager(lambda m, a, k, u=unit: self._unit_pre_forward(u, a, k)), prepend=True, with_kwargs=True
                )
            )
            self._handles.append(
                unit.module.register_forward_hook(eager(lambda m, a, o, u=unit: self._unit_post_forward(u, o))))

    # -- helpers ---------------------------------------------------------------------------
    def _next(self, order: List[ShardedUnit], unit: ShardedUnit) -> Optional[ShardedUnit]:
        try:
            i = order.index(unit)
        except ValueError:
            return None
        return order[i + 1] if i + 1 < len(order) else None

    def _unshard(self, unit: ShardedUnit, prefetch: Optional[ShardedUnit]) -> None:
        unit.gather()
        if prefetch is not None:
            with record_function(f"fsdp8::prefetch[{prefetch.name}]"):
                prefetch.gather()
        unit.wait_gather()
        unit.register(compute=True)

    def _cast_inputs(self, args, kwargs):
        dtype = self.cast_dtype
        if dtype is None:
            return args, kwargs

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
                return type(x)(cast(v) for v in x)
            if isinstance(x, dict):
                return {k: cast(v) for k, v in x.items()}
            return x

        return cast(args), cast(kwargs)

    def _register_pre_backward(self, unit: Optional[ShardedUnit], output) -> None:
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda grad, u=unit: self._pre_backward(u))

    # -- root ------------------------------------------------------------------------------
    def _root_pre_forward(self, module, args, kwargs):
        if self._preflight is not None:
            self._preflight()
            self._preflight = None
        if in_backward():
            if self.root_unit is not None:
                self._unshard(self.root_unit, None)
            return None
        if self.phase is Phase.AWAIT_BACKWARD:
            self._reshard_kept()
        if self.phase is Phase.IDLE:
            comm.iteration[0] += 1
            self._forward_calls.clear()
            self._expected_post.clear()
            self._reduced.clear()
            self._backward_started.clear()
        self.phase = Phase.FORWARD
        if self.root_unit is not None and not self.root_unit.gather_needs_scales:
            # Issued before the FP8 scale agreement: its all-gather overlaps the amax kernels.
            self.root_unit.gather()
        for callback in self.before_forward:
            callback()
        first = self.forward_order[0] if self.forward_order else None
        if self.root_unit is not None:
            self._forward_calls[self.root_unit] = self._forward_calls.get(self.root_unit, 0) + 1
            self._unshard(self.root_unit, first)
        elif first is not None:
            first.gather()
        return self._cast_inputs(args, kwargs)

    def _root_post_forward(self, module, args, output):
        if in_backward():
            return None
        if self.forward_order:
            self.order_frozen = True
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output)):
            self.phase = Phase.AWAIT_BACKWARD
            self._register_pre_backward(None, output)
        else:
            # No backward will follow: give modules their main weights back now.
            self._finish_iteration()
        return None

    # -- units -----------------------------------------------------------------------------
    def _unit_pre_forward(self, unit: ShardedUnit, args, kwargs):
        if in_backward():
            self._unshard(unit, None)
            return None
        self._forward_calls[unit] = self._forward_calls.get(unit, 0) + 1
        if not self.order_frozen and unit not in self.forward_order:
            self.forward_order.append(unit)
        self._unshard(unit, self._next(self.forward_order, unit))
        if not torch.is_grad_enabled():
            return None
        # Asynchronous-collective inputs are waited on here, outside any compiled forward
        # (comm.py [Note: async-collective inputs]).
        flat = [(i, comm.waited(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keyed = [(k, comm.waited(v)) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not flat and not keyed:
            return None
        self._expected_post[unit] = self._expected_post.get(unit, 0) + 1
        inputs = [a for _, a in flat] + [v for _, v in keyed]
        wrapped = _PostBackward.apply(self, unit, *inputs)
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        args = list(args)
        for (i, _), w in zip(flat, wrapped[: len(flat)]):
            args[i] = w
        kwargs = dict(kwargs)
        for (k, _), w in zip(keyed, wrapped[len(flat) :]):
            kwargs[k] = w
        return tuple(args), kwargs

    def _unit_post_forward(self, unit: ShardedUnit, output):
        if in_backward():
            return None
        if unit.reshard_after_forward:
            if self._backward_starts_with(unit):
                self._kept = unit
            else:
                unit.reshard()
                unit.register(compute=False)
        if torch.is_grad_enabled():
            self._register_pre_backward(unit, output)
        return None

    def _backward_starts_with(self, unit: ShardedUnit) -> bool:
        return (torch.is_grad_enabled() and self.order_frozen and bool(self.forward_order)
                and unit is self.forward_order[-1])

    def _reshard_kept(self) -> None:
        """Reshard what the last forward kept gathered for its backward."""
        for unit in (self._kept, self.root_unit):
            if unit is not None:
                unit.reshard()
                unit.register(compute=False)
        self._kept = None

    # -- backward --------------------------------------------------------------------------
    def _pre_backward(self, unit: Optional[ShardedUnit]) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self.phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if unit is None or unit in self._backward_started:
            return
        self._backward_started.add(unit)
        if not self.backward_recorded:
            self.backward_order.append(unit)
        order = self.backward_order if self.backward_recorded else self.forward_order[::-1]
        with record_function(f"fsdp8::pre_backward[{unit.name}]"):
            self._unshard(unit, self._next(order, unit))

    def post_backward(self, unit: ShardedUnit) -> None:
        remaining = self._expected_post.get(unit, 0) - 1
        self._expected_post[unit] = remaining
        if remaining <= 0:
            self._reduce(unit)

    def _reduce(self, unit: ShardedUnit, last: bool = False) -> None:
        """Reduce ``unit``'s gradients once its backward is done. Its unsharded parameters are
        freed first (ZeRO-3): nothing reads them any more, and the gradient buffers the
        reduction allocates then do not stack on top of them at the step's peak. The root
        keeps them until the ``last`` reduction of the backward (a tied or reused root
        parameter may still be read before that)."""
        with record_function(f"fsdp8::post_backward[{unit.name}]"):
            if unit is not self.root_unit or last:
                unit.reshard()
                if unit.shards_params:
                    unit.register(compute=False)
            pending = unit.reduce_grads(self.sync_grads)
            self._reduced.add(unit)
            # Keep at most one reduction in flight: its buffers are released once the
            # compute stream has waited for it (see comm.py [Note: streams and memory]).
            self._release_pending()
            self._pending = pending

    def _release_pending(self) -> None:
        if self._pending is not None:
            self._streams.wait(self._pending.event)
            self._pending = None

    def _end_of_backward(self) -> None:
        with record_function("fsdp8::end_of_backward"):
            for unit in self.units:
                used = self._forward_calls.get(unit, 0) > 0
                if used and (unit not in self._reduced or unit.has_unsharded_grads()):
                    self._reduce(unit)
            if self.root_unit is not None and self._forward_calls.get(self.root_unit, 0) > 0:
                self._reduce(self.root_unit, last=True)
            self._release_pending()
            self.backward_recorded = True
            self._finish_iteration()
        for callback in self.after_backward:
            callback()

    def _finish_iteration(self) -> None:
        self._kept = None
        for unit in self.all_units:
            unit.reshard()
            unit.register(compute=False)
        self._callback_queued = False
        self.phase = Phase.IDLE
