"""FP8 experts inside compiled graphs: the one-kernel path of fsdp8/fp8/grouped_kernel.py as three
custom ops, so that a compiled decoder layer keeps its MoE block in one graph.

[Note: FP8 experts, compiled]
Eagerly, ``fp8_grouped_mm`` is an opaque call in a compiled block (``torch.compiler.disable``): its
group-by-group paths read the group sizes on the host. Each call splits the block's forward and
backward graphs, and every piece pays the compiled code's runtime wrappers on the host. On a
Qwen3-MoE shape (model Q, one H200, 2026-11-27) the FP8 step ran 104 compiled graphs where bf16
ran 16, and the GPU sat idle for half of it, waiting for its host.

The one-kernel path (per-tensor scales, e4m3 gradients, a bf16 model, a GPU where the grouped kernel
passed its probe) reads nothing on the host, so it can live in the graph. Its steps become three
custom ops, opaque to the compiler but no graph break: the weight's quantization (a weight not
gathered in 8 bits), the forward (the input's quantization, written in both layouts, and the GEMM),
and the backward (the output gradient's quantization and both gradient GEMMs). The ops call the
same functions the eager path calls, so a compiled step computes the same bytes; what the eager
path shares through a ``Groups`` (each row's group, the padded buffer's columns) each op derives
again from the offsets, a launch or two. Under "hybrid" (e5m2 gradients, whose backward goes group
by group) and the block recipes the call stays opaque.
"""

from __future__ import annotations

import torch

from .formats import E4M3
from .grouped_kernel import GroupedBytes, Groups, backward_in_kernel, buffer_width, forward_in_kernel, quantize_experts
from .tensor import Float8Tensor
from .triton_grouped import transpose_bytes

_NONE = (0,)  # the shape of an output a call was not asked for


def _forward(x: torch.Tensor, w: torch.Tensor, inv_w: torch.Tensor, offs: torch.Tensor, keep_input: bool):
    out, qx = forward_in_kernel(x, w, inv_w, Groups(offs), padded=keep_input)
    return out, qx.padded_t if keep_input else x.new_empty(_NONE, dtype=E4M3), qx.inv


def _forward_shapes(x, w, inv_w, offs, keep_input):
    rows, k = x.shape
    padded = (k, buffer_width(rows, offs.shape[0])) if keep_input else _NONE
    return (x.new_empty(rows, w.shape[1]), x.new_empty(padded, dtype=E4M3),
            x.new_empty(offs.shape[0], dtype=torch.float32))


def _backward(dy: torch.Tensor, w: torch.Tensor, inv_w: torch.Tensor, offs: torch.Tensor, x_padded: torch.Tensor,
              inv_x: torch.Tensor, input_grad: bool, weight_grad: bool):
    dx, dw = backward_in_kernel(dy, transpose_bytes(w) if input_grad else None, inv_w, Groups(offs),
                                GroupedBytes(None, inv_x, x_padded), input_grad, weight_grad)
    return (dx if input_grad else dy.new_empty(_NONE)), (dw if weight_grad else dy.new_empty(_NONE))


def _backward_shapes(dy, w, inv_w, offs, x_padded, inv_x, input_grad, weight_grad):
    return (dy.new_empty((dy.shape[0], w.shape[2]) if input_grad else _NONE),
            dy.new_empty(tuple(w.shape) if weight_grad else _NONE))


def _weight(w: torch.Tensor):
    data, inv = quantize_experts(w.to(torch.bfloat16), E4M3)
    return data, inv


def _weight_shapes(w):
    return w.new_empty(w.shape, dtype=E4M3), w.new_empty(w.shape[0], dtype=torch.float32)


# Schemas written out: this module's annotations are strings, which torch 2.11 does not read.
_OPS = (
    ("experts_fp8_forward", _forward, _forward_shapes,
     "(Tensor x, Tensor w, Tensor inv_w, Tensor offs, bool keep_input) -> (Tensor, Tensor, Tensor)"),
    ("experts_fp8_backward", _backward, _backward_shapes,
     "(Tensor dy, Tensor w, Tensor inv_w, Tensor offs, Tensor x_padded, Tensor inv_x, bool input_grad, "
     "bool weight_grad) -> (Tensor, Tensor)"),
    ("experts_fp8_weight", _weight, _weight_shapes, "(Tensor w) -> (Tensor, Tensor)"),
)
for _name, _impl, _shapes, _schema in _OPS:
    torch.library.custom_op(f"fsdp8::{_name}", _impl, mutates_args=(), schema=_schema).register_fake(_shapes)


class TracedFp8Experts(torch.autograd.Function):
    """out = rows of group g of x times weight[g].T through the three ops (see the Note): what
    grouped.Fp8GroupedMm computes on the one-kernel path, traceable. Saved for backward: the
    weight's bytes and scales, and the input only as its padded bytes, where the weight's
    gradient will read them."""

    @staticmethod
    def forward(ctx, x, weight, offs, keep_input: bool):
        if isinstance(weight, Float8Tensor):  # the engine's bytes; read as attributes, which trace as tensors
            w, inv_w = weight._data, weight._scale_inv
        else:
            w, inv_w = torch.ops.fsdp8.experts_fp8_weight(weight.detach())
        out, x_padded, inv_x = torch.ops.fsdp8.experts_fp8_forward(x.detach().contiguous(), w, inv_w, offs,
                                                                  keep_input)
        ctx.save_for_backward(w, inv_w, offs, x_padded, inv_x)
        ctx.weight_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        w, inv_w, offs, x_padded, inv_x = ctx.saved_tensors
        input_grad, weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = torch.ops.fsdp8.experts_fp8_backward(dy.contiguous().to(torch.bfloat16), w, inv_w, offs, x_padded,
                                                      inv_x, input_grad, weight_grad)
        return dx if input_grad else None, dw.to(ctx.weight_dtype) if weight_grad else None, None, None


def traced_fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The one-kernel path as one node of a compiled graph (see the Note); the caller has checked
    that it applies (grouped.one_kernel, e4m3 gradients)."""
    keep_input = torch.is_grad_enabled() and weight.requires_grad
    return TracedFp8Experts.apply(x, weight, offs, keep_input)
