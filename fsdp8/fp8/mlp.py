"""A SwiGLU MLP's three FP8 linears as one autograd function, under block scaling (issue 17).

``down(silu(gate(x)) * up(x))`` with 1x128-scaled activations and gradients. Run as three
Float8Linears, the gradients of ``gate``'s and ``up``'s outputs cross autograd in bf16: the
SwiGLU backward writes them and each linear's backward reads them again to quantize them. As
one function, the backward makes them in FP8 straight from the saved ``g`` and ``u`` and the
gradient of ``h`` (fp8/swiglu.py, one kernel pair in place of four kernels), and ``h``'s
transpose for ``down``'s weight gradient with them.

Every value is the three linears' (same quantizations, same GEMMs, same roundings of the
SwiGLU ops): on the CPU the bytes are equal; on CUDA the kernels' approximate exponential can
move a value by one ulp of the dtype (fp8/swiglu.py). It is used where that holds: three
Float8Linears without bias or hooks under a recipe whose activations and gradients are 1x128
blocks, not tensor-parallel. Anything else runs the module's own forward.

``fuse_swiglu_mlps`` marks the MLPs swiglu_forms.py knows: those the model adapters recognise
(models/adapter.py ``swiglu_names``: fsdp8's own ``FeedForward``, Hugging Face's ``LlamaMLP`` form).
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .formats import Granularity
from .gemm import fp8_mm, input_transposed, quantize_both_ways, quantized_input, weight_operands, weight_transposed
from .kernels import Quantized, quantize
from .linear import Float8Linear
from .recipes import G, Recipe
from .swiglu import swiglu_backward
from .swiglu_forms import swiglu_names


def fusable_recipe(recipe: Recipe) -> bool:
    """1x128 activations and gradients (the fused backward's blocks), no delayed state."""
    return (recipe.x_granularity is Granularity.ROW_1x128 and recipe.g_granularity is Granularity.ROW_1x128
            and not recipe.delayed)


def _plain(linear: nn.Module) -> bool:
    return (isinstance(linear, Float8Linear) and linear.bias is None and not isinstance(linear.weight, DTensor)
            and not (linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks
                     or linear._backward_pre_hooks))


def fused_applies(gate: nn.Module, up: nn.Module, down: nn.Module) -> bool:
    """Whether ``down(silu(gate(x)) * up(x))`` can run as one function (see the module doc)."""
    return (_plain(gate) and _plain(up) and _plain(down) and gate.recipe == up.recipe == down.recipe
            and fusable_recipe(gate.recipe))


class _Float8SwiGLUFn(torch.autograd.Function):
    """out = down(silu(x @ gate.T) * (x @ up.T)) with the three linears' FP8 GEMMs. As
    Float8LinearFn: eager saves the input's FP8 transpose; a compiled graph quantizes the
    input outside (``qx_data``), so the compiler fuses it into the norm before, and saves the
    input itself."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, recipe: Recipe, qx_data=None, qx_scale_inv=None):
        dtype = x.dtype
        x2d = x.reshape(-1, x.shape[-1])
        qw_gate, _ = weight_operands(w_gate, recipe, None, dtype)
        qw_up, _ = weight_operands(w_up, recipe, None, dtype)
        qw_down, _ = weight_operands(w_down, recipe, None, dtype)
        if qx_data is not None:
            qx, qx_t, saved_x = Quantized(qx_data, qx_scale_inv, recipe.x_granularity), None, x
        else:
            (qx, qx_t), saved_x = quantized_input(x, x2d, recipe, None), None
        g = fp8_mm(qx, qw_gate, dtype, recipe, fast_accum=True)
        u = fp8_mm(qx, qw_up, dtype, recipe, fast_accum=True)
        h = F.silu(g) * u
        out = fp8_mm(quantize(h, recipe.fwd_dtype, recipe.x_granularity), qw_down, dtype, recipe, fast_accum=True)
        # The activations through save_for_backward, not ctx attributes: in a compiled block,
        # tensors kept as attributes lived until the whole backward was done (model B's g and
        # u, 224 MiB a layer: benchmarks/debug/swiglu_memory.py). The weights stay attributes,
        # as in Float8LinearFn: the engine refills their gathered buffers in place.
        ctx.save_for_backward(saved_x, g, u, *((qx_t.data, qx_t.scale_inv) if qx_t is not None else (None, None)))
        ctx.weights, ctx.qws = (w_gate, w_up, w_down), (qw_gate, qw_up, qw_down)
        ctx.recipe, ctx.x_shape = recipe, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        recipe = ctx.recipe
        x, g, u, qx_t_data, qx_t_scale = ctx.saved_tensors
        (w_gate, w_up, w_down), (qw_gate, qw_up, qw_down) = ctx.weights, ctx.qws
        dtype = g.dtype
        qdy, qdy_t = quantize_both_ways(dy.reshape(-1, dy.shape[-1]).to(dtype), recipe.g_granularity,
                                         recipe.bwd_dtype, None, G)
        dh = fp8_mm(qdy, weight_transposed(w_down, qw_down), dtype, recipe)
        grads = swiglu_backward(dh, g, u, recipe.bwd_dtype, recipe.fwd_dtype)
        dw_down = fp8_mm(qdy_t, grads.h_t, dtype, recipe)
        # Autograd would add the two linears' input gradients in the dtype: the same sum.
        dx = (fp8_mm(grads.dg, weight_transposed(w_gate, qw_gate), dtype, recipe)
              + fp8_mm(grads.du, weight_transposed(w_up, qw_up), dtype, recipe))
        if qx_t_data is not None:
            qx_t = Quantized(qx_t_data, qx_t_scale, recipe.x_granularity)
        else:
            qx_t = input_transposed(x, recipe)
        dw_gate = fp8_mm(grads.dg_t, qx_t, dtype, recipe)
        dw_up = fp8_mm(grads.du_t, qx_t, dtype, recipe)
        ctx.weights = ctx.qws = None
        return (dx.view(ctx.x_shape), dw_gate.to(w_gate.dtype), dw_up.to(w_up.dtype), dw_down.to(w_down.dtype),
                None, None, None)


def float8_swiglu(x: torch.Tensor, gate: Float8Linear, up: Float8Linear, down: Float8Linear) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` as one autograd function (``fused_applies`` must hold)."""
    recipe = gate.recipe
    if not torch.compiler.is_compiling():
        return _Float8SwiGLUFn.apply(x, gate.weight, up.weight, down.weight, recipe)
    qx = quantize(x.detach().reshape(-1, x.shape[-1]), recipe.fwd_dtype, recipe.x_granularity)
    return _Float8SwiGLUFn.apply(x, gate.weight, up.weight, down.weight, recipe, qx.data, qx.scale_inv)


class _FusedSwiGLU:
    """Mixed into a SwiGLU MLP's class by ``fuse_swiglu_mlps``: runs it as one function when
    ``fused_applies``, else as the class's own forward. ``_fsdp8_swiglu`` names its gate, up
    and down linears."""

    _fsdp8_swiglu: Tuple[str, str, str]

    def forward(self, x):
        gate, up, down = (getattr(self, name) for name in self._fsdp8_swiglu)
        if fused_applies(gate, up, down):
            return float8_swiglu(x, gate, up, down)
        return super().forward(x)


_FUSED_CLASSES: Dict[type, type] = {}


def fuse_swiglu_mlps(model: nn.Module, recipe: Recipe) -> int:
    """Mark every SwiGLU MLP of ``model`` that fsdp8 knows to run as one function where it can
    (see the module doc), in place: its class becomes ``Float8SwiGLU<Class>``. Under a recipe
    it cannot fuse, or with ``FSDP8_FUSE_SWIGLU=0``, nothing changes. Returns how many."""
    if not fusable_recipe(recipe) or os.environ.get("FSDP8_FUSE_SWIGLU", "1") == "0":
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, _FusedSwiGLU):
            continue
        names = swiglu_names(module)
        if names is None:
            continue
        base = type(module)
        if base not in _FUSED_CLASSES:
            _FUSED_CLASSES[base] = type(f"Float8SwiGLU{base.__name__}", (_FusedSwiGLU, base), {"_fsdp8_swiglu": names})
        module.__class__ = _FUSED_CLASSES[base]
        count += 1
    return count
