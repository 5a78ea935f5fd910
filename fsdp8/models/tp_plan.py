"""The words a model family's tensor-parallel plan is written in: FamilyPlan (the plan and the facts that
check it), and the styles fsdp8 adds to torch's: ReplicateParallel, GatherSequenceOnce and
ExpertParallelBlock.

Here, below parallel/, because adapters (adapter.py) return plans and parallel/tp.py applies them."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

Plan = Dict[str, Optional[ParallelStyle]]


class ReplicateParallel(ParallelStyle):
    """A module every TP rank computes whole, on the same replicated input: a norm on the
    residual stream without sequence parallelism. Nothing is split; its parameters become
    ``Replicate()`` DTensors on the mesh, its first input is taken as replicated and its
    output handed back as a plain tensor. Why: torch's foreach and fused optimizers (their
    default on GPUs) and ``clip_grad_norm_`` refuse a list that mixes plain tensors with
    DTensors, so a tensor-parallel model must have no plain parameter left. The gradient
    is right without communication: every rank computes it from the same input and the same
    output gradient (the column-parallel layers after the norm all-reduce that one)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, device_mesh, partition_fn=_replicate_parameters,
                                 input_fn=_replicated_input, output_fn=_local_output)


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):  # every rank holds the same values: no broadcast
            replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    if not inputs or not isinstance(inputs[0], torch.Tensor):
        return inputs
    x = inputs[0]
    x = x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor) else \
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return (x, *inputs[1:])


def _local_output(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output


class GatherSequenceOnce(ParallelStyle):
    """The sequence-sharded hidden states a module (attention, an MLP) hands to several
    column-parallel projections, gathered once in its forward pre-hook, in compiled layers.

    torch's ColwiseParallel gathers its input per projection. Compiled, the forward's identical
    gathers merge, but each gather's backward stays a reduce-scatter of that projection's whole
    input gradient: three for q/k/v and two for gate/up, where one per input does (the partial
    sums add up locally first). Gathered here, the projections get a replicated DTensor, which
    Float8ColwiseParallel passes on as it is, and the one redistribution's backward sums the
    partials once. Eager layers are left to the projections, which share one gather per input
    by a cache on it (fp8/tp.py), in FP8 bytes where the recipe allows; a compiled graph cannot
    keep such a cache. The hidden states are the first positional input or the keyword
    ``hidden_states`` (Hugging Face modules use either); anything else passes through."""

    def __init__(self, sequence_dim: int = 1):
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sharded = Shard(self.sequence_dim)

        def gather(_module, args, kwargs):
            if not torch.compiler.is_compiling():
                return None
            if args and _sequence_sharded(args[0], sharded):
                return (args[0].redistribute(device_mesh, [Replicate()]), *args[1:]), kwargs
            if _sequence_sharded(kwargs.get("hidden_states"), sharded):
                whole = kwargs["hidden_states"].redistribute(device_mesh, [Replicate()])
                return args, {**kwargs, "hidden_states": whole}
            return None

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def _sequence_sharded(x, placement: Shard) -> bool:
    return isinstance(x, DTensor) and x.device_mesh.ndim == 1 and x.placements[0] == placement


def beside_router_and_experts(block: nn.Module) -> List[str]:
    """The parameters of a mixture-of-experts ``block`` outside its ``gate`` and ``experts``
    (shared experts, say), which ExpertParallelBlock has no tensor-parallel layout for."""
    return [name for name, _ in block.named_parameters() if not name.startswith(("gate.", "experts."))]


class ExpertParallelBlock(ParallelStyle):
    """A mixture-of-experts block (router ``gate`` + ``experts``) inside a tensor-parallel model
    whose experts expert parallelism splits (fsdp8.parallel.ep): the block computes on this
    rank's tokens as plain tensors, the router is replicated over tp, the experts are left to
    expert parallelism.

    [Note: an MoE block under tensor parallelism]
    Its input is the norm's output: with ``sequence_parallel`` a ``Shard(1)`` DTensor (this tp
    rank's part of every sequence), else the whole sequences, which every tp rank holds. The
    block takes the local tensor (its gradient handed back as ``Shard(1)``), so each tp rank
    routes and dispatches its own tokens, and gives its output back as ``Shard(1)`` (a DTensor
    unless ``use_local_output``, as torch's RowwiseParallel) or plain.

    The router's parameters become ``Replicate()`` DTensors, and it computes on plain tensors:
    this rank's tokens and its parameters' local values (``_router_on_local_values``), whose
    gradient is ``Partial`` over tp when tp ranks routed different tokens (sequence parallel; the
    engine sums it), and replicated, counted once, when they routed the same ones. Plain, because
    the router's ``torch.topk`` on a DTensor has no working backward before torch 2.12 (its
    gradient is scattered into a plain zeros tensor: "aten.scatter.src got mixed torch.Tensor and
    DTensor"), and a model's own router cannot be rewritten to avoid topk. Its first output
    (the logits or probabilities that a load-balancing loss reads) is handed back for all the
    block's tokens in the input's (batch, sequence) order, gathered over tp under sequence
    parallelism, so that loss is the one of the whole rows on every tp rank, as one process
    computes it; its gradient flows back to each rank's own tokens. The other outputs (the
    chosen experts and their weights) stay this rank's."""

    def __init__(self, sequence_parallel: bool = False, use_local_output: bool = True):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gate = getattr(module, "gate", None)
        if not isinstance(gate, nn.Module) or not isinstance(getattr(module, "experts", None), nn.Module):
            raise ValueError(f"ExpertParallelBlock applies to a mixture-of-experts block with 'gate' and 'experts' "
                             f"children, got {type(module).__name__}")
        outside = beside_router_and_experts(module)
        if outside:
            raise ValueError(f"ExpertParallelBlock: {type(module).__name__} holds {outside[0]!r} beside its router and "
                             "experts (shared experts?), which it has no tensor-parallel layout for")
        _replicate_parameters("gate", gate, device_mesh)
        _router_on_local_values(gate, [Partial()] if self.sequence_parallel else [Replicate()])
        # This call's local [batch, sequence]: the order the gathered router output comes back in.
        # The key is there from the start, so a compiled caller does not recompile once it is filled.
        shape = {"rows": ()}

        def block_input(_, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.to_local(grad_placements=x.placements)
            shape["rows"] = tuple(x.shape[:-1])
            return (x, *args[1:])

        def block_output(_, args, out):
            if not self.sequence_parallel or self.use_local_output:
                return out
            if isinstance(out, tuple):  # the built-in Llama's (output, load-balancing loss)
                return (DTensor.from_local(out[0], device_mesh, [Shard(1)], run_check=False), *out[1:])
            return DTensor.from_local(out, device_mesh, [Shard(1)], run_check=False)

        def gate_output(_, args, out):
            if not self.sequence_parallel:
                return out
            first, *rest = out
            # Every tp rank's rows, so the load-balancing loss sees whole sequences; its gradient
            # (the same on every tp rank) comes back as this rank's rows, not summed.
            everyone = DTensor.from_local(first, device_mesh, [Shard(0)], run_check=False)
            first = _in_sequence_order(everyone.redistribute(device_mesh, [Replicate()]).to_local(),
                                       device_mesh.size(), shape["rows"])
            return (first, *rest)

        module.register_forward_pre_hook(block_input)
        module.register_forward_hook(block_output)
        gate.register_forward_hook(gate_output)
        return module


def _router_on_local_values(router: nn.Module, grad_placements: list) -> None:
    """Make ``router``'s forward read each DTensor parameter as its local tensor, the gradient
    arriving as ``grad_placements``; the parameters themselves stay registered (the engine,
    checkpoints and optimizers see the DTensors), swapped back after every call. A bound method
    on the instance, so that a deep copy of the model binds it to the copy's router."""
    router._fsdp8_local_grad_placements = list(grad_placements)
    router.forward = types.MethodType(_forward_on_local_values, router)


def _forward_on_local_values(self: nn.Module, *args, **kwargs):
    held = dict(self._parameters)
    self._parameters.update({name: p.to_local(grad_placements=self._fsdp8_local_grad_placements)
                             for name, p in held.items() if isinstance(p, DTensor)})
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        self._parameters.update(held)


def _in_sequence_order(gathered: torch.Tensor, tp: int, rows: tuple) -> torch.Tensor:
    """Rows gathered over tp (rank-major: each rank's [batch, local sequence] flattened) in
    the order of the whole [batch, sequence]."""
    if len(rows) != 2:
        return gathered  # no sequence dimension to interleave
    batch, local = rows
    return gathered.view(tp, batch, local, -1).transpose(0, 1).reshape(batch * tp * local, -1)


@dataclass
class FamilyPlan:
    """A model family's automatic plan and the facts needed to check it.

    ``styles``: module pattern -> style; patterns that match no module are skipped (a
    family's plan may name optional modules). ``heads``: ``(config name, count, pattern)``
    for head counts that tp must divide when the module matching ``pattern`` (the
    projection that yields those heads) is column-sharded. ``vocab_modules``: FQNs whose
    vocabulary dim may be uneven over tp (torch's vocab-sharded embedding and colwise head
    handle uneven chunks). ``unsupported``: pattern -> the family's name of a style with
    no torch equivalent; the caller's plan must cover those modules."""

    styles: Plan
    heads: List[Tuple[str, int, str]] = field(default_factory=list)
    vocab_modules: Tuple[str, ...] = ()
    unsupported: Dict[str, str] = field(default_factory=dict)
