"""Sequence parallel under FP8: a sequence-sharded input all-gathered as FP8 bytes, once for
every column-parallel linear it feeds, its gradient reduce-scattered back once.

[Note: one gather per input]
Under sequence parallelism a decoder layer's q/k/v projections read one sequence-sharded
tensor, and so do its gate and up projections. Gathered by each projection (as a plain
ColwiseParallel or torchao's Float8ColwiseParallel do) that tensor costs, per projection and
pass, a max all-reduce of its amax over tp (the per-tensor scale of the whole input), an
all-gather of its FP8 bytes, a transposed copy kept for the weight gradient and, in backward,
a reduce-scatter of the input gradient. Those collectives are latency-bound and, on a 4-GPU
dp 2 x tp 2 step of an 8-layer 4096-wide model, nothing hid them (docs/PERFORMANCE.md,
section 6).

``SequenceGather`` does that work once per distinct input: its forward quantizes this rank's
tokens with the whole input's scale and all-gathers the bytes; its output is a *placeholder*
of the gathered shape (one element broadcast, no memory) that carries the FP8 operands to
every linear fed from it. Each linear's backward returns its full-length partial input
gradient to the placeholder, autograd sums them, and ``SequenceGather``'s backward
reduce-scatters the sum once. The bytes each linear computes with are those a per-linear
gather gives (same scale, same FP8 values), so results are unchanged; only the number of
collectives falls (5 -> 2 gathers, amax all-reduces and reduce-scatters a Llama layer).

Sharing needs one scale for all readers, so it applies to current scaling; delayed scaling
(each linear's own scale from its history) gathers per linear through the same function.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed import comm
from .formats import Granularity
from .gemm import group_scale
from .kernels import Quantized, amax, quantize
from .recipes import X, DelayedState, Recipe

T = TypeVar("T")


def gathered_shape(shape, dim: int, group) -> torch.Size:
    full = list(shape)
    full[dim] *= dist.get_world_size(group)
    return torch.Size(full)


def gather_fp8_bytes(x: torch.Tensor, recipe: Recipe, state: Optional[DelayedState], dim: int,
                     group) -> Tuple[Quantized, Quantized]:
    """This rank's tokens ``x`` quantized with the whole input's per-tensor scale (agreed over
    ``group``; delayed scaling: the state's, its amax recorded for the step's reduction), the
    FP8 bytes all-gathered along ``dim``: the input (rows, K) and its transpose (K, rows), the
    transpose exact for a per-tensor scale, so no high-precision copy of the whole input exists."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    if state is not None:
        scale = state.scale[X]
        state.record(X, amax(x2d))  # this rank's amax; the engine's step all-reduce takes the max
    else:
        scale = group_scale(x2d, recipe.fwd_dtype, group)
    q = quantize(x2d, recipe.fwd_dtype, Granularity.TENSOR, scale)
    ranks = dist.get_world_size(group)
    local = q.data.view(torch.uint8).reshape(-1)
    gathered = torch.empty(ranks * local.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered, local, group, "fp8 sequence-parallel input")
    full = gathered.view((ranks,) + tuple(x.shape)).movedim(0, dim).reshape(-1, x.shape[-1])
    qx = Quantized(full.view(recipe.fwd_dtype), q.scale_inv, Granularity.TENSOR)
    return qx, qx.t().contiguous()


def reduce_scatter_sum(dx: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The input gradient's partial sums over tp, summed and cut back to this rank's tokens."""
    ranks = dist.get_world_size(group)
    shape = list(dx.shape)
    shape[dim : dim + 1] = [ranks, shape[dim] // ranks]
    pieces = dx.reshape(shape).movedim(dim, 0).contiguous()
    if ranks == 1:
        return pieces[0]
    out = torch.empty(pieces[0].numel(), dtype=dx.dtype, device=dx.device)
    comm.reduce_scatter_single_fn()(out, pieces.view(-1), op=dist.ReduceOp.SUM, group=group)
    return out.view(pieces.shape[1:])


class SequenceGather(torch.autograd.Function):
    """x (this rank's tokens) -> a placeholder of the gathered shape whose ``fp8_operands``
    are the gathered input in both layouts; backward: the summed input gradient of every
    linear fed from it, reduce-scattered (see the note)."""

    @staticmethod
    def forward(ctx, x, recipe: Recipe, state: Optional[DelayedState], dim: int, group):
        operands = gather_fp8_bytes(x, recipe, state, dim, group)
        ctx.dim, ctx.group = dim, group
        placeholder = x.new_zeros(()).expand(gathered_shape(x.shape, dim, group))
        outputs = operands[0].data, operands[0].scale_inv, operands[1].data
        ctx.mark_non_differentiable(*outputs)
        return (placeholder,) + outputs

    @staticmethod
    def backward(ctx, dx, *_):
        return reduce_scatter_sum(dx, ctx.dim, ctx.group), None, None, None, None


def shared_per_input(x: DTensor, name: str, key: tuple, make: Callable[[], T]) -> T:
    """``make()``, computed once for the DTensor ``x`` and kept on it (attribute ``name``) while
    ``key`` and ``x``'s values stay the same: what the projections fed one input share (its
    gather, in FP8 here or in high precision by Float8ColwiseParallel). It lives as long as ``x``."""
    key = (x._local_tensor._version,) + key
    cached = getattr(x, name, None)
    if cached is None or cached[0] != key:
        cached = key, make()
        setattr(x, name, cached)
    return cached[1]


def sequence_gather(x: DTensor, recipe: Recipe, state: Optional[DelayedState], dim: int,
                    group) -> Tuple[torch.Tensor, Tuple[Quantized, Quantized]]:
    """The gathered input's placeholder and its FP8 operands, for the sequence-sharded DTensor
    ``x``: shared by every linear fed the same ``x`` with current scaling (``shared_per_input``);
    delayed scaling (each linear's own scale) gathers per call. Eager only: compiled layers trace
    the linears and gather in high precision (tp_forward.py [Note: FP8 under TP, compiled])."""

    def gather():
        placeholder, data, scale_inv, data_t = SequenceGather.apply(x.to_local(), recipe, state, dim, group)
        return placeholder, (Quantized(data, scale_inv, Granularity.TENSOR),
                             Quantized(data_t, scale_inv, Granularity.TENSOR))

    if state is not None:
        return gather()
    return shared_per_input(x, "_fsdp8_sequence_gather", (recipe.fwd_dtype, dim, id(group)), gather)
