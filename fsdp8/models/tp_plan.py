"""The words a model family's tensor-parallel plan is written in: FamilyPlan (the plan and the facts that
check it) and ReplicateParallel, the one style fsdp8 adds to torch's.

Here, below parallel/, because adapters (adapter.py) return plans and parallel/tp.py applies them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
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
