"""parallelize(): one call that lays a model out over the world mesh (TP, checkpointing, compile, sharding).

[Note: the order of parallelize]
1. Every check that needs only the config, the model's structure and the world size, on
   every rank alike, so a mistake raises everywhere before any rank communicates.
2. ``make_mesh``: the world mesh ``(dp_replicate, dp_shard, cp, tp)``.
3. Tensor parallelism (``tensor_parallel``): it must come before sharding, because the
   engine takes a TP parameter as a DTensor and shards its local piece.
4. Context parallelism (``context_parallel``): the attention of each rank's sequence chunks.
5. ``fully_shard`` over the data-parallel dims (``dp_shard`` flattened with ``cp``: cp ranks
   hold different tokens of the same rows, so they share parameter shards like dp ranks),
   converting linears to FP8 inside; it picks the units.
6. Activation checkpointing, then ``torch.compile``, of each unit's forward: the units are
   exactly the engine's, and both wrap the instance's ``forward``, inside the engine's
   hooks (checkpointing.py [Note: checkpointing inside the engine's hooks]). Wrapping a
   forward changes no module, name or parameter, so doing it after sharding is the same as
   before it, except that nothing has to guess which modules will be units.
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..config import ParallelConfig, check_checkpointing_with_cp, resolve_precision
from ..distributed.mesh import make_expert_mesh, make_mesh, mesh_dims, token_groups, tp_mesh
from ..distributed.process_group import init_distributed, mesh_device
from ..engine.model import fully_shard
from ..engine.sharded import ShardedModel
from ..engine.units_and_mesh import find_units
from ..fp8.grouped import probe_before_compiling
from ..models.adapter import ModelAdapter, adapter_for
from .auto import auto_choice, describe_choice
from .checkpointing import checkpoint_units, filter_training_calls
from .cp import context_parallel, loss_divisor, shard_sequence
from .ep import check_expert_parallel, computed_in_fp8, expert_parallel
from .tp import tensor_parallel


@dataclass(frozen=True)
class _Layout:
    mesh: DeviceMesh
    config: ParallelConfig
    dp_rank: int
    dp_size: int
    cp: int


class ParallelizedModel:
    """What ``parallelize`` adds to the ShardedModel it returns: where this rank stands in
    the world mesh, and so which rows of each global batch it trains on."""

    _fsdp8_parallel: _Layout

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (``dp_replicate x dp_shard``); the
        ranks of one tensor-parallel group share it (and their batch)."""
        return self._fsdp8_parallel.dp_rank

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks split each global batch: ``dp_replicate x dp_shard``
        (what ``DistributedSampler(num_replicas=...)`` takes, with ``rank=model.dp_rank``)."""
        return self._fsdp8_parallel.dp_size

    @property
    def device_mesh(self) -> DeviceMesh:
        """The world mesh, dimensions named ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (sizes > 1;
        ``dp_shard`` always); e.g. ``model.device_mesh["cp"]`` for the context-parallel group."""
        return self._fsdp8_parallel.mesh

    @property
    def parallel_config(self) -> ParallelConfig:
        return self._fsdp8_parallel.config

    def shard_batch(self, batch: Mapping[str, Any]) -> Dict[str, Any]:
        """This rank's part of a global batch (``{"input_ids": ..., "labels": ..., ...}``):
        rows ``[dp_rank * b, (dp_rank + 1) * b)`` of every tensor, ``b = rows / dp_size``, on
        the model's device (views of a batch already there; a host batch, e.g. a DataLoader's,
        has only these rows copied over, asynchronously from pinned memory). A tensor with one row beside larger ones (HF
        ``position_ids`` of shape ``(1, seq)``) is broadcast over the batch and passed whole,
        as are numbers, strings, None and 0-d tensors.

        With context parallelism, each row's sequence is then cut into this rank's chunks
        (``fsdp8.parallel.cp.shard_sequence``: Hugging Face labels shifted before the cut,
        global ``position_ids`` added), and ``num_items_in_batch`` is added (the global
        batch's valid labels over the data-parallel x cp ranks: one all-reduce, so every rank
        must call this) for the loss to be the mean over the whole global batch."""
        layout = self._fsdp8_parallel
        device = mesh_device(layout.mesh)
        rows = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in take_rows(batch, self.dp_rank, self.dp_size).items()}
        return cut_sequences(rows, layout.mesh, layout.config.sequence_parallel) if layout.cp > 1 else rows


_PASSED_WHOLE = (int, float, bool, str, type(None))


def take_rows(batch: Mapping[str, Any], rank: int, size: int) -> Dict[str, Any]:
    """Rows ``[rank * b, (rank + 1) * b)`` of every batched tensor in ``batch``, ``b = rows / size``."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_batch takes a dict of tensors (input_ids, labels, ...), got {type(batch).__name__}")
    rows = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not rows:
        raise ValueError(f"shard_batch found no tensor with a batch dimension among {sorted(batch)}")
    sizes = set(rows.values())
    total = max(sizes)
    if sizes - {1, total}:
        raise ValueError(f"the batch's tensors disagree on the number of rows: {rows}; give every tensor the "
                         "global batch as its first dimension")
    if total % size:
        raise ValueError(
            f"the global batch has {total} rows, which {size} data-parallel ranks cannot split evenly; make the "
            f"global batch size a multiple of model.dp_size = {size}"
        )
    b = total // size
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and (value.shape[0] == total or total == 1):
            out[key] = value[rank * b : (rank + 1) * b]
        elif isinstance(value, (torch.Tensor,) + _PASSED_WHOLE):
            out[key] = value
        else:
            raise TypeError(
                f"shard_batch cuts tensors along their first dimension and cannot tell whether batch[{key!r}] "
                f"({type(value).__name__}) holds one entry per row; leave it out, or cut it yourself with "
                "model.dp_rank and model.dp_size"
            )
    return out


def cut_sequences(rows: Dict[str, Any], mesh: DeviceMesh, sequence_parallel: bool) -> Dict[str, Any]:
    """This cp rank's chunks of the sequences of ``rows`` and the loss divisor that goes with them."""
    sequences = {k: v for k, v in rows.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    out = {k: v for k, v in rows.items() if k not in sequences}
    out.update(shard_sequence(sequences, mesh, sequence_parallel))
    labels = out.get("labels", out.get("targets"))  # this rank's, shifted for HF models
    if labels is not None and "num_items_in_batch" not in out:
        out["num_items_in_batch"] = loss_divisor(labels, mesh)
    return out


def parallelize(model: nn.Module, config: Union[ParallelConfig, str, None] = None) -> ShardedModel:
    """Lay ``model`` out over every rank as ``config`` says and return it sharded, in place.

    Builds the world mesh, applies tensor (and sequence) and context parallelism, shards
    parameters, gradients and optimizer state over the data-parallel ranks (FP8 conversion inside),
    and checkpoints and compiles each unit; see [Note: the order of parallelize]. What it
    needs to know of the model (units, TP plan, attention) comes from the model's adapter
    (``fsdp8.models.adapter_for``; models/adapter.py [Note: model adapters]): Hugging Face
    causal LMs need nothing else, their decoder layers are the units and their
    ``base_model_tp_plan`` the TP plan. The result is a ShardedModel that is also a
    ``ParallelizedModel``: feed it ``model.shard_batch(global_batch)``, and use
    ``model.dp_rank`` / ``model.dp_size`` for samplers. Any torch optimizer works on
    ``model.parameters()``. ``config="auto"`` takes the layout fsdp8.planner.search predicts
    fastest on this job's GPUs (one 2048-token sequence per GPU); ``model.parallel_config``
    says which."""
    config = ParallelConfig() if config is None else config
    if isinstance(config, str) and config == "auto":
        init_distributed()
        best = auto_choice(model)
        if dist.get_rank() == 0:  # every rank chose the same
            print(describe_choice(best, torch.cuda.is_available()), file=sys.stderr, flush=True)
        config = best.parallel
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallelize takes a fsdp8.ParallelConfig or 'auto', got {config!r}")
    _check_model(model, config)
    adapter = adapter_for(model)
    # Asked now, so that a model without the checks raises before anything is communicated.
    skip_packed = adapter.skip_packed_sequence_check(model) if config.skip_packed_sequence_check else None
    init_distributed()
    sizes = mesh_dims(dist.get_world_size(), config.dp_replicate, config.dp_shard, config.cp, config.tp)
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    _check_tensor_parallel(model, config, tp, adapter)
    check_checkpointing_with_cp(config.activation_checkpointing, cp)  # cp=-1 resolved
    if cp > 1 and not adapter.supports_context_parallel(model):
        raise ValueError(
            f"context parallelism (cp={cp}) replaces the attention of fsdp8's Llama and of Hugging Face models, not "
            f"of {type(model).__name__}; use cp=1, or build the world mesh yourself and call "
            "fsdp8.parallel.cp.ContextAttention from your model's attention"
        )
    experts = _check_expert_parallel(model, config.ep, sizes, adapter)
    balanced = adapter.load_balancing_modules(model) if config.load_balancing == "global" else []
    offload = _offload_kwargs(config)

    mesh = make_mesh(config.dp_replicate, config.dp_shard, config.cp, config.tp)
    if tp > 1:
        _apply_tensor_parallel(model, config, tp_mesh(mesh), experts)
    if cp > 1:
        context_parallel(model, mesh, config.sequence_parallel)
    if balanced:  # the router loss counts the experts' tokens of the global batch
        groups = token_groups(mesh)
        for module in balanced:
            module.load_balancing_groups = groups
    precision = resolve_precision(config.precision, mesh.device_type)
    units = config.units if config.units is not None else adapter.units(model)
    expert_mesh = make_expert_mesh(mesh, config.ep) if experts else None
    if experts:
        expert_parallel(model, expert_mesh, config.sequence_parallel, config.fp8_dispatch)
        units = _units_and_experts(model, units, experts)
    elif config.fp8 is not None:
        computed_in_fp8(model)
    sharded = fully_shard(model, mesh=mesh, units=units, strategy=config.strategy,
                          outer_strategy=config.outer_strategy, precision=precision,
                          reshard_after_forward=config.reshard_after_forward, fp8=config.fp8, expert_mesh=expert_mesh,
                          **offload)
    # Experts modules are units of their own (their mesh differs) inside the decoder layers,
    # which checkpointing and compiling already cover.
    expert_ids = {id(m) for m in experts.values()}
    unit_modules = [unit.module for unit in sharded._fsdp8.units if id(unit.module) not in expert_ids]
    # What a training call must not carry (a KV cache) is taken out once, by the outermost wrapper:
    # before the compiled code where units are compiled (a cache in another state at each layer
    # would compile the layers' shared code again for the next layer), else before checkpointing.
    filter_call = adapter.checkpoint_filter(model)
    if config.activation_checkpointing != "none":
        checkpoint_units(unit_modules, config.activation_checkpointing, None if config.compiled else filter_call,
                         compiled=config.compiled)
    if config.compiled:
        options = compile_options(config)
        if config.fp8 is not None:
            probe_before_compiling(model, mesh_device(mesh))
        for module in unit_modules:
            compiled = torch.compile(module.forward, **options)
            module.forward = filter_training_calls(compiled, filter_call, module.forward)
    if skip_packed is not None:
        skip_packed()
    dp_rank, dp_size = _data_parallel_place(mesh)
    sharded._fsdp8_parallel = _Layout(mesh, config, dp_rank, dp_size, cp)
    sharded.__class__ = _parallelized_class(type(sharded))
    return sharded


# torch 2.13's DTensor hashes a symbolic shape (pytorch#185190); torch 2.11's does not (seen on
# the GPU machines); 2.12 was not tried, so it counts as not.
_DTENSOR_HASHES_SYMBOLIC_SHAPES = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def compile_options(config: ParallelConfig) -> Dict[str, Any]:
    """The torch.compile keyword arguments of each unit: the user's, and ``dynamic=False`` under
    tensor parallelism (DTensor parameters and inputs) on torch before 2.13 unless the user says
    otherwise. There, a
    unit recompiled for a second shape (a graph break, e.g. an opaque FP8 linear with delayed
    scaling, is compiled again for each distinct linear shape) would make the DTensor inputs'
    sizes symbolic, which torch 2.11's DTensor cannot hash ("unhashable type: non-nested
    SymInt", seen on GPUs with FP8 under TP). Static shapes recompile per shape instead."""
    options = {} if config.compile is True else dict(config.compile)
    if config.tp > 1 and not _DTENSOR_HASHES_SYMBOLIC_SHAPES:
        options.setdefault("dynamic", False)
    return options


def _check_model(model: nn.Module, config: ParallelConfig) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModel):
        raise RuntimeError(f"{type(model).__name__} is already sharded; parallelize takes the plain model, once")
    distributed = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if distributed:
        raise ValueError(
            f"{type(model).__name__} already has DTensor parameters ({', '.join(distributed[:3])}); parallelize "
            "applies tensor parallelism itself (ParallelConfig(tp=N, tp_plan=...)): pass the plain model"
        )
    # transformers 5.2x renamed the property (the old name warns).
    hf_checkpointing = next((name for name in ("is_activation_checkpointing", "is_gradient_checkpointing")
                             if hasattr(type(model), name)), None)
    if config.activation_checkpointing != "none" and hf_checkpointing and getattr(model, hf_checkpointing):
        raise ValueError(
            "the model has Hugging Face gradient checkpointing enabled as well as "
            f"activation_checkpointing={config.activation_checkpointing!r}, which would recompute twice; call "
            f"model.{hf_checkpointing[3:]}_disable() and let parallelize checkpoint"
        )


def _check_tensor_parallel(model: nn.Module, config: ParallelConfig, tp: int, adapter: ModelAdapter) -> None:
    if tp == 1:
        wanting = [name for name in ("sequence_parallel", "loss_parallel", "tp_plan") if getattr(config, name)]
        if wanting:
            raise ValueError(f"{' and '.join(wanting)} need tensor parallelism, but tp came out as 1 on "
                             f"{dist.get_world_size()} ranks; give tp a size > 1 or drop {' and '.join(wanting)}")
        return
    if config.tp_plan is None and adapter.tp_plan(model, config.sequence_parallel, config.loss_parallel) is None:
        raise ValueError(
            f"no automatic tensor-parallel plan for {type(model).__name__} ({adapter.no_tp_plan_hint}); pass "
            "ParallelConfig(tp_plan={'module pattern': ParallelStyle, ...}) with torch's ColwiseParallel / "
            "RowwiseParallel styles, or use tp=1"
        )


def _check_expert_parallel(model: nn.Module, ep: int, sizes: Dict[str, int],
                           adapter: ModelAdapter) -> Dict[str, nn.Module]:
    """The experts modules ep > 1 splits ({} for ep = 1), after every check that needs no mesh."""
    dp_shard, tp = sizes["dp_shard"], sizes.get("tp", 1)
    choices = [d for d in range(1, dp_shard + 1) if dp_shard % d == 0]
    if ep == 1:
        if tp > 1 and adapter.experts(model):
            raise ValueError(
                f"tp={tp} with a mixture-of-experts model and ep=1: tensor parallelism splits attention and dense "
                f"layers, and the experts go to expert parallelism; set ep to a divisor > 1 of dp_shard={dp_shard} "
                f"(the ranks left beside tp={tp}{', so lower tp' if dp_shard == 1 else ''}), or use tp=1"
            )
        return {}
    if dp_shard % ep:
        beside = f" (the world of {dist.get_world_size()} ranks over tp={tp} and the other dims)" if tp > 1 else ""
        raise ValueError(
            f"ep={ep} must divide dp_shard={dp_shard}{beside}: expert parallelism borrows its ranks from the "
            f"data-parallel shard dim; choose ep among {choices}, or change dp_shard{' or lower tp' if tp > 1 else ''}"
        )
    return check_expert_parallel(model, ep, tp)


def _units_and_experts(model: nn.Module, units, experts: Dict[str, nn.Module]):
    """The units ``units`` selects, plus every experts module as a unit of its own."""
    names = {name for name, _ in find_units(model, units)} | set(experts)
    return lambda name, module: name in names


def _apply_tensor_parallel(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh,
                           experts: Dict[str, nn.Module]) -> None:
    try:
        tensor_parallel(model, mesh, plan=config.tp_plan, sequence_parallel=config.sequence_parallel,
                        loss_parallel=config.loss_parallel, placed_elsewhere=tuple(experts))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e} (parallelize passes ParallelConfig.tp_plan as tensor_parallel's plan)") from None


def _offload_kwargs(config: ParallelConfig) -> Dict[str, Any]:
    if config.offload is None:
        return {}
    if "offload" not in inspect.signature(fully_shard).parameters:
        raise NotImplementedError(
            f"offload={config.offload!r}: this fsdp8's fully_shard cannot offload yet; use offload=None"
        )
    return {"offload": config.offload}


def _data_parallel_place(mesh: DeviceMesh):
    """(rank, size) of this rank among the data-parallel ranks: its coordinates in the
    ``dp_replicate`` and ``dp_shard`` dims, replicate-major."""
    names = list(mesh.mesh_dim_names)
    dims = [name for name in ("dp_replicate", "dp_shard") if name in names]
    rank = 0
    for name in dims:
        rank = rank * mesh.shape[names.index(name)] + mesh.get_local_rank(name)
    return rank, math.prod(mesh.shape[names.index(name)] for name in dims)


_PARALLELIZED_CLASSES: Dict[type, type] = {}


def _parallelized_class(cls: type) -> type:
    # The name stays Sharded<Class>: what fully_shard's models are called.
    if cls not in _PARALLELIZED_CLASSES:
        _PARALLELIZED_CLASSES[cls] = type(cls.__name__, (ParallelizedModel, cls), {})
    return _PARALLELIZED_CLASSES[cls]
