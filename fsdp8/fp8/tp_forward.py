"""FP8 linears under tensor parallelism: local FP8 GEMMs on DTensor pieces (Float8Linear's forward
when its weight is a DTensor).

[Note: FP8 under TP]
torch's ParallelStyles hand a linear DTensors: the weight split by rows (colwise) or by
columns (rowwise), the input replicated, sequence-sharded or split by columns. A
Float8Linear computes on the local pieces and says what its output is (colwise: its
columns, ``Shard(-1)``; rowwise: a partial sum, ``Partial()``), so the styles' own
redistributions around it stay as they are. What FP8 adds is scale agreement: a
per-tensor scale must be the scale of the *whole* tensor, so the amax of every operand
that is a shard (the weight; the input of a rowwise layer; the output gradient of a
colwise one) is max-reduced over tp before quantizing, and a TP run equals one process
running the same recipe. Block scales need no agreement when no block straddles two
ranks, which ``tp_fp8_ok`` checks before a layer is converted.

With sequence parallelism a colwise layer gets its input sequence-sharded; for
per-tensor recipes it quantizes its tokens with the agreed scale and all-gathers the FP8
bytes, as torchao's Float8ColwiseParallel does, instead of letting the style gather the
input in high precision; linears fed the same input share that gather (tp_gather.py [Note:
one gather per input]).

[Note: FP8 under TP, compiled]
In a compiled layer, a current- or block-scaled FP8 linear under TP is traced into the
layer's graph, with no graph break (``traced=True``): the input is taken as torch's
ColwiseParallel takes it (DTensor gathers a sequence-sharded input in high precision, which
the compiler may merge for the projections fed one input, as in bf16 layers), it is quantized
in the graph, and the scale agreements over tp are functional all-reduces (comm.maxed) the
compiler schedules with the rest. Host-side work per linear and step (Python, DTensor
dispatch, several small eager kernels per scale, a c10d call per agreement) was what made an
opaque FP8 linear slower under TP than the bf16 one it replaces (docs/PERFORMANCE.md, section
6). The FP8 bytes each GEMM computes with are the same as in eager mode; only where the
sequence gather happens (before quantizing, not after) differs, and a per-tensor scale of the
whole input is the same either way. The input gradient goes back as torch's ColwiseParallel
sends it: each linear's partial sum stays a partial sum (``_placed``), the partials of the
linears fed one input add up locally, and the style's redistribution sums them over tp once (a
reduce-scatter under sequence parallelism). Delayed scaling (a state updated on the host) stays
an opaque eager call.

A rowwise layer's bias is added on tp rank 0 only (its output is a partial sum), so the
bias gradient is a partial sum too, which the engine sums over tp with the norms'.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .formats import Granularity
from .gemm import TensorParallelGemm, input_in_graph
from .linear_fn import Float8LinearFn
from .recipes import Recipe, update_delayed_states
from .tp_gather import sequence_gather


def _kind(weight: DTensor) -> str:
    placement = weight.placements[0]
    if isinstance(placement, Shard):
        return "colwise" if placement.dim == 0 else "rowwise"
    return "replicated"


def tp_fp8_ok(linear: nn.Linear, recipe: Recipe) -> Optional[str]:
    """Why ``linear``'s tensor-parallel pieces cannot run ``recipe`` as one process would
    (None if they can): FP8 GEMM dims must be multiples of 16, and a split dimension must
    not cut a scaling block (128 for block scaling, 32 for MX)."""
    weight = linear.weight
    if not isinstance(weight, DTensor):
        return None
    if weight.device_mesh.ndim != 1:
        return f"placed on a {weight.device_mesh.ndim}-D mesh (FP8 supports 1-D tensor parallelism)"
    local = weight._local_tensor.shape
    if local[0] % 16 or local[1] % 16:
        return f"its tensor-parallel piece {tuple(local)} has a dimension that is not a multiple of 16"
    kind = _kind(weight)
    block = {Granularity.BLOCK_128x128: 128, Granularity.ROW_1x128: 128, Granularity.MX_1x32: 32}
    size = max(block.get(g, 1) for g in (recipe.x_granularity, recipe.w_granularity, recipe.g_granularity))
    split = {"colwise": local[0], "rowwise": local[1]}.get(kind)
    if split is not None and split % size:
        return (f"its {kind} piece splits a {size}-wide scaling block ({split} is not a multiple of {size}); "
                "use a tensor-parallel degree that keeps the pieces whole blocks, or per-tensor scaling")
    return None


def _placed(x: DTensor, placement) -> DTensor:
    """``x`` with ``placement`` on the 1-D tp mesh, redistributed only if it differs. Redistributing
    to the placement a tensor already has is not free: a colwise linear's input gradient is a
    partial sum, and the backward of a replicated-to-replicated redistribution sums it (``Partial``
    to ``Replicate``: an all-reduce of the whole activation per linear). Left as it is, the partial
    sums of the linears fed one input (q/k/v, gate/up) add up locally and the redistribution that
    made the input whole sums them once: under sequence parallelism, one reduce-scatter, as torch's
    ColwiseParallel does in bf16."""
    if x.placements[0] == placement:
        return x
    return x.redistribute(x.device_mesh, [placement])


def tensor_parallel_forward(module: nn.Module, x, traced: bool = False) -> DTensor:
    """A Float8Linear ``module``'s forward when its weight is a tensor-parallel DTensor (see the
    notes; ``traced``: inside a compiled graph, current or block scaling)."""
    weight, recipe = module.weight, module.recipe
    mesh = weight.device_mesh
    reason = tp_fp8_ok(module, recipe)
    if reason is not None:
        raise ValueError(f"this Float8Linear cannot run under tensor parallelism: {reason}; keep it in high "
                         "precision (fsdp8 does so automatically when it converts a model after TP)")
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    # Scale agreements: functional collectives over the mesh in a graph, c10d ones eagerly.
    group = mesh if traced else mesh.get_group(0)
    state = None if traced else module.delayed_state(x.device)
    if state is not None and not module.external_delayed_update and state.dirty:
        # Standalone use: fold last step's amaxes in, agreed over tp (the engine does it per step).
        update_delayed_states([state], module.amax_reduction_group or group)
    kind = _kind(weight)
    bias = module.bias.to_local() if isinstance(module.bias, DTensor) else module.bias
    if kind == "rowwise":
        x_local, placement = _placed(x, Shard(x.ndim - 1)).to_local(), Partial()
        tp = TensorParallelGemm(group, x_sharded=True)
        if bias is not None:
            if isinstance(module.bias, DTensor):
                bias = module.bias.to_local(grad_placements=[Partial()])
            if mesh.get_local_rank() != 0:
                bias = bias * 0  # added once to the partial sums; a zero gradient here
    elif kind == "colwise":
        placement, gathered = Shard(x.ndim - 1), None
        seq = x.placements[0]
        if (not traced and recipe.x_granularity is Granularity.TENSOR and isinstance(seq, Shard)
                and seq.dim % x.ndim != x.ndim - 1 and x.shape[seq.dim] % mesh.size() == 0):
            x_local, gathered = sequence_gather(x, recipe, state, seq.dim % x.ndim, group)
        else:
            # Each rank's input gradient is a partial sum, and stays one: see _placed.
            x_local = _placed(x, Replicate()).to_local(grad_placements=[Partial()])
        tp = TensorParallelGemm(group, dy_sharded=True, gathered=gathered)
    else:  # whole on every rank: so is the input gradient
        x_local, placement = _placed(x, Replicate()).to_local(), Replicate()
        tp = TensorParallelGemm(group, w_sharded=False)
    if traced:
        qx, x_scale = input_in_graph(x_local, recipe, tp.amax_group(tp.x_sharded))
        out = Float8LinearFn.apply(x_local, weight.to_local(), bias, recipe, None, qx.data, qx.scale_inv, tp, None,
                                   None, x_scale)
    else:
        out = Float8LinearFn.apply(x_local, weight.to_local(), bias, recipe, state, None, None, tp)
    return DTensor.from_local(out, mesh, [placement], run_check=False)
