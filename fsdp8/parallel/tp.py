"""Tensor parallelism: pick torch ParallelStyles for a model's modules and apply them with parallelize_module.

The layers themselves are torch's (``torch.distributed.tensor.parallel``); this file takes a
model's automatic plan from its adapter (``adapter_for(model).tp_plan``: the built-in Llama's in
models/llama_adapter.py, Hugging Face models' from their ``base_model_tp_plan`` in models/hf_tp.py),
merges the caller's plan into it, checks every shape against the TP degree before anything is
communicated, and keeps tied weights tied.

[Note: errors before collectives]
``parallelize_module`` scatters each weight from TP rank 0 as it goes, so a shape that
fails half-way leaves the other ranks waiting in a collective. Every check here (plan keys,
divisibility, tied placements) runs on the model's structure alone, which every rank
holds identically, so every rank raises the same error before the first collective.
"""

from __future__ import annotations

import math
import re
from fnmatch import fnmatchcase
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..models.adapter import adapter_for
from ..models.tp_plan import FamilyPlan, Plan
from ..models.tp_plan import ReplicateParallel  # noqa: F401  (README's fsdp8.parallel.tp.ReplicateParallel)


def resolve_plan(names: List[str], automatic: Plan, user: Optional[Mapping[str, Optional[ParallelStyle]]]) -> Plan:
    """Module FQN -> style, in ``names`` order: the automatic patterns, then the user's.

    Patterns are ``fnmatch`` patterns over FQNs (``*`` also spans dots). A user pattern
    replaces what earlier patterns gave the modules it matches (``None``: leave them
    unsharded); every user pattern must match a module."""
    resolved: Plan = {}
    for pattern, style in automatic.items():
        for name in names:
            if fnmatchcase(name, pattern):
                resolved[name] = style
    for pattern, style in (user or {}).items():
        if style is not None and not isinstance(style, ParallelStyle):
            raise TypeError(
                f"plan[{pattern!r}] must be a torch ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...) "
                f"or None, got {type(style).__name__}"
            )
        matched = [name for name in names if fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(
                f"plan key {pattern!r} matches no module of the model; keys are fnmatch patterns over "
                f"module names such as {', '.join(repr(n) for n in names[:4])}"
            )
        for name in matched:
            resolved[name] = style
    order = {name: i for i, name in enumerate(names)}
    return {name: resolved[name] for name in sorted(resolved, key=order.__getitem__) if resolved[name] is not None}


def _check_unsupported(names: List[str], unsupported: Mapping[str, str], user: Mapping, model_name: str) -> None:
    """Raise if a module with a family style that has no torch equivalent is left to it."""
    left = {}
    for pattern, kind in unsupported.items():
        for name in names:
            if fnmatchcase(name, pattern) and not any(fnmatchcase(name, p) for p in user):
                left.setdefault(f"{pattern} ({kind!r})", name)
    if left:
        raise ValueError(
            f"{model_name}'s tensor-parallel plan uses styles with no torch ParallelStyle equivalent: "
            f"{', '.join(left)}; pass plan={{pattern: ParallelStyle or None}} covering those modules "
            f"(e.g. {next(iter(left.values()))!r})"
        )


def _divisors(n: int) -> Tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _sharded_dim(module: nn.Module, style: ParallelStyle) -> Optional[Tuple[str, int]]:
    """``(what, size)`` of the dim ``style`` splits over tp in ``module``, if any."""
    if isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return "out_features", module.out_features
        if isinstance(style, RowwiseParallel):
            return "in_features", module.in_features
    if isinstance(module, nn.Embedding):
        if isinstance(style, RowwiseParallel):
            return "num_embeddings", module.num_embeddings
        if isinstance(style, ColwiseParallel):
            return "embedding_dim", module.embedding_dim
    return None


def check_shapes(modules: Mapping[str, nn.Module], plan: Plan, tp: int, family: Optional[FamilyPlan]) -> None:
    """Raise one ValueError naming the head counts and module dims that tp does not divide, and
    the tp values that divide them all (every head count and split dim, not only the failing ones).

    Vocabulary dims may be uneven (torch's vocab-sharded embedding, colwise head and
    loss_parallel handle unequal chunks): an embedding's rows, and the family's head."""
    heads = [(name, count) for name, count, pattern in (family.heads if family else [])
             if any(fnmatchcase(fqn, pattern) and isinstance(style, ColwiseParallel) for fqn, style in plan.items())]
    dims: Dict[int, List[str]] = {}  # a size tp splits -> the modules it splits it in
    vocab = family.vocab_modules if family else ()
    for fqn, style in plan.items():
        module = modules[fqn]
        dim = _sharded_dim(module, style)
        if dim is None or fqn in vocab or (isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel)):
            continue
        # One name for all layers: the same module in every block fails the same way.
        pattern = re.sub(r"[.]\d+[.]", ".*.", fqn)
        names = dims.setdefault(dim[1], [])
        if pattern not in names:
            names.append(pattern)
    wrong = []
    if any(count % tp for _, count in heads):
        wrong.append(" and ".join(f"{name}={count}" for name, count in heads if count % tp)
                     + " (each rank computes whole heads)")
    if any(size % tp for size in dims):
        wrong.append("the split dims " + " and ".join(f"{size} ({', '.join(names)})" for size, names in dims.items()
                                                      if size % tp))
    if wrong:
        working = _divisors(math.gcd(*[count for _, count in heads], *dims))
        fix = f"use tp in {working}, which divide them all" if len(working) > 1 else "no tp > 1 divides them all"
        raise ValueError(f"tensor_parallel: tp={tp} must divide {', and '.join(wrong)}; {fix}")


def _predicted_placement(module: nn.Module, param_name: str, style: Optional[ParallelStyle]) -> Optional[Placement]:
    """How ``style`` will place ``module.<param_name>`` (None: stays a plain tensor)."""
    if style is None or isinstance(style, PrepareModuleInput):
        return None
    if isinstance(style, SequenceParallel):
        return Replicate()
    linear = isinstance(module, nn.Linear)
    if isinstance(module, (nn.Linear, nn.Embedding)) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
        colwise = isinstance(style, ColwiseParallel)
        if param_name == "bias":
            return Shard(0) if colwise else Replicate()
        return Shard(0) if colwise == linear else Shard(1)
    raise LookupError  # a style of the user's own: compared after it ran


def _tied_groups(modules: Mapping[str, nn.Module], plan: Plan) -> List[List[Tuple[str, str]]]:
    """Owners ``(module FQN, param name)`` of each parameter held by several modules;
    raises when the plan would place a shared parameter differently in its owners."""
    owners: Dict[int, List[Tuple[str, str]]] = {}
    for fqn, module in modules.items():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((fqn, name))
    groups = [group for group in owners.values() if len(group) > 1]
    for group in groups:
        try:
            placements = {owner: _predicted_placement(modules[owner[0]], owner[1], plan.get(owner[0]))
                          for owner in group}
        except LookupError:
            continue
        if len(set(placements.values())) > 1:
            described = ", ".join(
                f"{fqn or '<root>'}.{name} as {repr(placement) if placement else 'a plain tensor'}"
                for (fqn, name), placement in placements.items()
            )
            raise ValueError(
                f"tied parameter placed differently by the plan: {described}; give tied modules styles "
                "that shard the shared weight the same way (e.g. a vocab-sharded embedding with a colwise head)"
            )
    return groups


def _retie(modules: Mapping[str, nn.Module], groups: List[List[Tuple[str, str]]]) -> None:
    # Each style swapped in its own DTensor for the shared parameter: point every owner
    # back at the first one's, so the tie (one parameter, one gradient) survives.
    for (first_fqn, first_name), *rest in groups:
        shared = modules[first_fqn]._parameters[first_name]
        for fqn, name in rest:
            other = modules[fqn]._parameters[name]
            same = (type(other) is type(shared) and other.shape == shared.shape
                    and getattr(other, "placements", None) == getattr(shared, "placements", None))
            if not same:
                raise ValueError(
                    f"tied parameter {first_fqn}.{first_name} and {fqn}.{name} came out of the plan's styles "
                    f"with different layouts ({getattr(shared, 'placements', 'plain')} vs "
                    f"{getattr(other, 'placements', 'plain')}); give tied modules matching styles"
                )
            modules[fqn]._parameters[name] = shared


def _check_sequence_length(tp: int):
    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("tokens"))
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tokens.shape[1] % tp:
            raise ValueError(
                f"sequence length {tokens.shape[1]} is not divisible by tp={tp}: sequence parallelism splits "
                f"every sequence evenly over the tp ranks; pad sequences to a multiple of {tp}"
            )

    return hook


def _warn_plain(model: nn.Module, placed_elsewhere: Tuple[str, ...]) -> None:
    """A plan (the caller's) that leaves some parameters plain tensors beside DTensors: say
    so once, since the optimizer's first foreach step would fail far from the cause."""
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)
             and not any(name.startswith(module + ".") for module in placed_elsewhere)]
    if plain:
        import warnings

        warnings.warn(f"tensor_parallel left {len(plain)} parameters as plain tensors among DTensors ({', '.join(plain[:3])}"
                      f"{', ...' if len(plain) > 3 else ''}): torch's foreach and fused optimizers and clip_grad_norm_ "
                      "refuse such a mix; give their modules a style in plan= (fsdp8.parallel.tp.ReplicateParallel() "
                      "for a module computed whole on a replicated input)", stacklevel=3)


def tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Optional[Mapping[str, Optional[ParallelStyle]]] = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    placed_elsewhere: Tuple[str, ...] = (),
) -> nn.Module:
    """Split ``model``'s layers over the 1-D ``tp_mesh`` with torch's ParallelStyles; returns ``model``.

    The plan is automatic where the model's adapter has one (fsdp8.models.adapter_for): the
    built-in Llama, Hugging Face models with a ``config.base_model_tp_plan`` (plus their
    embedding and head), a family a user registered; ``plan``
    (``{"module pattern": ParallelStyle or None}``, fnmatch over module names) overrides
    and extends it, or is the whole plan for other models. ``sequence_parallel``: the
    Megatron sequence-parallel layout (norms on sequence shards; sequence lengths must be
    multiples of tp). ``loss_parallel``: the head's logits stay vocabulary-sharded
    DTensors; compute the loss and call ``backward()`` inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` so no rank holds the full
    logits (the built-in Llama's ``model(tokens, targets)`` and an HF causal LM's
    ``labels=`` loss both work there). Parameters become DTensors on ``tp_mesh``; tied
    weights stay one parameter. Raises on every rank, before any communication, for plan
    keys that match nothing and for shapes tp does not divide. ``placed_elsewhere``: names of
    modules whose parameters the caller places itself (``parallelize``'s experts, which
    expert parallelism splits), not warned about as left plain."""
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(
            f"tp_mesh must be a 1-D DeviceMesh, got {tp_mesh!r}; take it from the world mesh with "
            "fsdp8.distributed.tp_mesh(fsdp8.make_mesh(tp=N))"
        )
    distributed = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if distributed:
        raise ValueError(
            f"{type(model).__name__} already has DTensor parameters ({', '.join(distributed[:3])}, ...); apply "
            "tensor_parallel once, to the plain model, before fully_shard"
        )
    family = adapter_for(model).tp_plan(model, sequence_parallel, loss_parallel)
    if family is None and plan is None:
        raise ValueError(
            f"no automatic tensor-parallel plan for {type(model).__name__} (there is one for fsdp8's Llama and for "
            "Hugging Face models whose config.base_model_tp_plan names their modules); "
            "pass plan={'module pattern': ParallelStyle, ...}"
        )
    modules = dict(model.named_modules())
    names = [name for name in modules if name]
    resolved = resolve_plan(names, family.styles if family else {}, plan)
    if family is not None:
        _check_unsupported(names, family.unsupported, plan or {}, type(model).__name__)
    if not resolved:
        raise ValueError(f"the tensor-parallel plan shards no module of {type(model).__name__}; pass plan=")
    tp = tp_mesh.size()
    check_shapes(modules, resolved, tp, family)
    tied = _tied_groups(modules, resolved)
    for name, style in resolved.items():
        parallelize_module(modules[name], tp_mesh, style)
    _retie(modules, tied)
    _warn_plain(model, placed_elsewhere)
    if sequence_parallel:
        model.register_forward_pre_hook(_check_sequence_length(tp), with_kwargs=True)
    return model
