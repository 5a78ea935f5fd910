"""Float8ColwiseParallel: torch's ColwiseParallel for FP8 layers, which gather a sequence-sharded
input themselves, as FP8 bytes (tp_forward.py [Note: FP8 under TP])."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from .formats import Granularity
from .linear import Float8Linear
from .tp_gather import shared_per_input


class Float8ColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel, except that an FP8 layer with per-tensor scaling receives a
    sequence-sharded input as it is and gathers it itself as FP8 bytes (half a bf16
    gather). Other modules, and block-scaled layers, get the high-precision gather. The
    choice is made at each forward, so the style can be applied before fully_shard(fp8=...)
    converts the layer, as torchao's Float8ColwiseParallel cannot. Projections fed the same
    sequence-sharded input share one gather, in FP8 (tp_gather.py) or in high precision; an input
    that arrives gathered (GatherSequenceOnce, in compiled layers) is taken as it is."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        placement = input_layouts[0] if input_layouts else None
        x = inputs[0]
        if isinstance(x, DTensor) and x.placements == tuple(desired_input_layouts):
            # Gathered already (models/tp_plan.py GatherSequenceOnce). Redistributing it again would
            # all-reduce this projection's whole input gradient in backward (Partial to Replicate).
            return x
        gathers_itself = (isinstance(mod, Float8Linear) and mod.recipe.x_granularity is Granularity.TENSOR
                          and isinstance(placement, Shard) and placement.dim != -1
                          and placement.dim != x.ndim - 1)
        if gathers_itself:
            return x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
        if not isinstance(x, DTensor) or torch.compiler.is_compiling():
            return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        # One high-precision gather per input, shared by the projections it feeds (q/k/v,
        # gate/up): autograd sums their gradients before the gather's single reduce-scatter.
        return shared_per_input(
            x, "_fsdp8_colwise_input", (tuple(desired_input_layouts or ()), id(device_mesh)),
            lambda: ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh))
