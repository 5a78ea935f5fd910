"""FP8 weights under torch's own FSDP: an 8-bit all-gather for FSDP2, process groups for FSDP1.

``Float8TrainingWeight`` wraps a high-precision weight (what the optimizer updates) and
implements FSDP2's tensor-subclass extension: ``fsdp_pre_all_gather`` quantizes the local
shard to FP8 with one scale for the whole tensor, FSDP2 all-gathers the bytes, and
``fsdp_post_all_gather`` hands the Float8Linear a Float8Tensor over them. Every other op
runs on the wrapped tensor; those FSDP2 applies while sharding and padding (split, view,
slice, copy_, new_zeros, as_strided, detach, clone, _to_copy, ...) keep the wrapper.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..distributed import comm
from .formats import Granularity, amax_to_scale, scale_to_inv
from .kernels import amax, saturate_cast
from .linear import Float8Linear
from .recipes import Recipe
from .tensor import Float8Tensor

aten = torch.ops.aten
_KEEP_WRAPPER = {
    aten.detach.default, aten.alias.default, aten.clone.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.narrow.default, aten.new_zeros.default, aten.new_empty.default,
    aten.empty_like.default, aten.zeros_like.default, aten._to_copy.default, aten.t.default,
    aten._pin_memory.default, aten.copy_.default,
}


class Float8TrainingWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers as FP8 bytes (per-tensor scale)."""

    _tensor: torch.Tensor
    _recipe: Recipe

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, recipe: Recipe, scale: Optional[torch.Tensor] = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.shape, strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, recipe: Recipe, scale: Optional[torch.Tensor] = None):
        self._tensor = tensor
        self._recipe = recipe
        self._scale = scale  # set by precompute_fp8_scales: one all-reduce for all weights

    def __repr__(self) -> str:
        return f"Float8TrainingWeight({self._tensor!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], (self._recipe, self._scale)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8TrainingWeight(inner["_tensor"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in args if isinstance(a, Float8TrainingWeight)) if any(
            isinstance(a, Float8TrainingWeight) for a in args) else None
        unwrap = lambda t: t._tensor if isinstance(t, Float8TrainingWeight) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if out is None:  # foreach in-place ops return nothing
            return None
        if func._schema.name.endswith("_") or func is aten.copy_.default:
            return args[0]  # in place: the wrapper itself
        if func in _KEEP_WRAPPER and first is not None:
            wrap = lambda t: Float8TrainingWeight(t, first._recipe, first._scale) if isinstance(t, torch.Tensor) else t  # noqa: E731
            return tree_map(wrap, out)
        return out

    # -- FSDP2 extension ---------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        dtype = getattr(mp_policy, "param_dtype", None) or self._tensor.dtype
        local = self._tensor.to(dtype)
        scale = self._scale
        if scale is None:  # not precomputed: agree on this tensor's scale now (one all-reduce)
            local_amax = amax(local).to(local.device)
            comm.all_reduce(local_amax, mesh.get_group(), dist.ReduceOp.MAX, "fp8 weight amax (FSDP2)")
            scale = amax_to_scale(local_amax, self._recipe.fwd_dtype)
        data = saturate_cast(local, scale, self._recipe.fwd_dtype).view(torch.uint8)
        padded_rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] < padded_rows:  # uneven or empty shard: FSDP2 gathers equal, padded pieces
            pad = data.new_zeros((padded_rows - data.shape[0],) + tuple(data.shape[1:]))
            data = torch.cat([data, pad])
        return (data,), (scale_to_inv(scale), dtype)

    def fsdp_post_all_gather(self, all_gather_outputs: Tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None):
        (data,) = all_gather_outputs
        scale_inv, dtype = metadata
        cols = tuple(self._tensor.shape[1:])
        fp8 = data.view(self._recipe.fwd_dtype).view((-1,) + cols)  # padded rows; FSDP2 narrows them off
        if out is not None:
            # FSDP2 refilled the same storage: only the scale is new.
            out._scale_inv = scale_inv
            out.clear_transpose()
            return
        return Float8Tensor(fp8, scale_inv, Granularity.TENSOR, dtype), (data,)


def use_fp8_all_gather(model: nn.Module) -> List[str]:
    """Wrap the weights of ``model``'s Float8Linears so that torch FSDP2 all-gathers them in
    8 bits (per-tensor recipes only). Call before ``torch.distributed.fsdp.fully_shard``."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear) and not isinstance(module.weight, Float8TrainingWeight):
            if module.recipe.w_granularity is not Granularity.TENSOR:
                raise ValueError(f"{name}: FSDP2 FP8 all-gather supports per-tensor recipes, not {module.recipe.name}")
            w = module.weight
            module.weight = nn.Parameter(Float8TrainingWeight(w.data, module.recipe), requires_grad=w.requires_grad)
            names.append(name)
    return names


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if hasattr(p, "_local_tensor") else p


def precompute_fp8_scales(model: nn.Module, param_dtype: torch.dtype = torch.bfloat16) -> None:
    """One max all-reduce for the scales of every FSDP2-sharded FP8 weight (call after each
    optimizer step); without it each weight reduces its own amax at its all-gather.
    ``param_dtype`` is FSDP2's compute dtype: weights are quantized from that rounding."""
    weights = [(p, _local(p)) for p in model.parameters() if isinstance(_local(p), Float8TrainingWeight)]
    if not weights:
        return
    # Rounding is monotonic, so the amax of the rounded weight is the rounded amax.
    amaxes = torch.stack([amax(local._tensor).to(param_dtype).float() for _, local in weights])
    group = weights[0][0].device_mesh.get_group() if hasattr(weights[0][0], "device_mesh") else None
    comm.all_reduce(amaxes, group, dist.ReduceOp.MAX, "fp8 weight amaxes (FSDP2)")
    for (_, local), value in zip(weights, amaxes):
        local._scale = amax_to_scale(value, local._recipe.fwd_dtype)


def prepare_fp8_modules_for_fsdp(fsdp_root: nn.Module) -> int:
    """Give every Float8Linear inside torch's ``FullyShardedDataParallel`` (FSDP1) wrappers the
    wrapper's process group, so delayed scaling reduces its amaxes over the data-parallel
    ranks. Call after wrapping; returns how many Float8Linears got a group."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    count = 0
    for wrapper in fsdp_root.modules():
        if not isinstance(wrapper, FullyShardedDataParallel):
            continue
        for module in wrapper.modules():
            if isinstance(module, Float8Linear):
                module.amax_reduction_group = wrapper.process_group
                count += 1
    if count == 0:
        raise ValueError("prepare_fp8_modules_for_fsdp found no Float8Linear inside a FullyShardedDataParallel wrapper")
    return count
