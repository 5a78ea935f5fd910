"""Activation checkpointing of sharded units: full recomputation or torchtitan's selective op policy.

[Note: checkpointing inside the engine's hooks]
Each unit's ``forward`` (the instance attribute, so the module, its name and its place in
the model stay as they are) is replaced by one that runs the original through
``torch.utils.checkpoint`` (non-reentrant). The engine's hooks live on the module's
``__call__``, outside that forward: in forward they gather the unit once, and in backward
the unit's pre-backward hook (on its outputs) gathers it before autograd reaches the
checkpointed nodes, whose first saved-tensor access recomputes the forward with the
parameters already there. Recomputation calls the original forward directly, not the
module, so it runs no hook and gathers nothing: each unit is all-gathered once in forward
and once in backward, as without checkpointing (tests/dist/test_parallelize.py counts
them). For the same reason ``torch.compile`` of a unit's forward wraps this one, keeping
both the checkpoint and the engine's hooks consistent: the hooks outside, the
checkpointed region inside the compiled code.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Callable, Dict, Iterable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..models.adapter import CallFilter

_aten = torch.ops.aten


def _ops(namespace, *names: str) -> set:
    """The default overloads of the named ops that this torch build has."""
    found = set()
    for name in names:
        packet = getattr(namespace, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.add(packet.default)
    return found


# Matrix products, counted together for "every second one": torch.mm, a linear with
# bias (addmm), and the FP8 GEMM.
_MATMULS = _ops(_aten, "mm", "addmm", "_scaled_mm")

# Outputs kept under "selective": expensive to recompute for their size. Attention
# kernels (every SDPA backend, the CPU one included), reduce-scatters of sequence-parallel
# layers (recomputing them would communicate again), and amaxes: the per-tensor FP8
# scale's reduction over a whole activation (fsdp8's amax is aminmax, or amax of the absolute
# values in compiled code; max for others').
_SAVED = (
    _ops(_aten, "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_fused_attention_overrideable", "aminmax", "amax", "max")
    | _ops(torch.ops._c10d_functional, "reduce_scatter_tensor")
)


def _selective_policy(counts: Dict[str, int]):
    def policy(ctx, op, *args, **kwargs):
        if op in _MATMULS:
            # Forward and recomputation count separately, so both see the same parity.
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            # Odd ones kept, even ones recomputed (torchtitan's choice): half the GEMMs'
            # outputs for one extra GEMM in two.
            keep = counts[key] % 2 == 1
        else:
            keep = op in _SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_contexts():
    """The ``context_fn`` of selective checkpointing: a fresh matmul count per call."""
    return create_selective_checkpoint_contexts(_selective_policy(defaultdict(int)))


def _full_compiled_policy(ctx, op, *args, **kwargs):
    """Full checkpointing in a compiled unit: everything recomputed, except the outputs of random
    ops that compute on a CPU (see compiled_full_contexts)."""
    random = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    if random and any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def compiled_full_contexts():
    """The ``context_fn`` of full checkpointing in a compiled unit.

    AOTAutograd recomputes a random op (SDPA counts as one, whatever its dropout) with the RNG state
    of its forward, which it passes from the forward graph to the backward. On a CPU (no graph-safe
    RNG) torch 2.13 appends that state after the forward's saved opaque objects, the DeviceMesh of
    DTensor parameters among them, and its runtime then reads the mesh as a saved tensor ("expected all
    tensors_saved_with_vc_check to be Tensors"): every compiled layer under tensor parallelism
    failed. CUDA tensors take the graph-safe path, which passes the state as inputs and is not
    affected. So on CPUs the random ops' outputs (attention's) are kept, and the rest recomputed."""
    return create_selective_checkpoint_contexts(_full_compiled_policy)


def filter_training_calls(call: Callable, filter_call: Optional[CallFilter], forward: Callable) -> Callable:
    """``call`` (a unit's ``forward`` checkpointed or compiled) whose calls with gradients enabled
    first pass ``filter_call(forward)``: what a training call must not carry (the model adapter's
    ``checkpoint_filter``; Hugging Face layers drop the KV cache). ``call`` itself without a filter."""
    adapt = filter_call(forward) if filter_call is not None else None
    if adapt is None:
        return call

    @functools.wraps(call)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            args, kwargs = adapt(args, kwargs)
        return call(*args, **kwargs)

    return run


def _checkpointed(forward: Callable, context_fn: Optional[Callable], filter_call: Optional[CallFilter]):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # nothing is saved for a backward that never comes
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return filter_training_calls(run, filter_call, forward)


def checkpoint_units(modules: Iterable[nn.Module], mode: str, filter_call: Optional[CallFilter] = None,
                     compiled: bool = False) -> None:
    """Recompute each module's activations in backward: ``mode`` ``"full"`` or ``"selective"``.

    ``filter_call(forward)`` gives the function that adapts the arguments of each checkpointed
    call (the model adapter's ``checkpoint_filter``: Hugging Face layers drop their KV cache, as
    a recomputation would append to it a second time). ``compiled``: the modules' forwards will be
    compiled around the checkpoint (full checkpointing then takes compiled_full_contexts)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use 'full' or 'selective'")
    if mode == "selective":
        context_fn = selective_contexts
    else:
        context_fn = compiled_full_contexts if compiled else None
    for module in modules:
        module.forward = _checkpointed(module.forward, context_fn, filter_call)
