"""FP8 GEMMs of mixture-of-experts experts: ``fp8_grouped_mm``, the FP8 form of
fsdp8.models.moe.grouped_mm, and the mark by which conversion knows an experts forward that runs it.

[Note: FP8 experts]
An experts module stores E matrices as one 3-D weight [E, N, K] and is fed rows sorted by expert,
``offs`` holding the groups' cumulative row ends. Each expert is a linear of its own, so each is
quantized as a dense Float8Linear (linear_fn.py) would quantize that expert alone on its rows, and
its out, dx and dw are that linear's:

- per-tensor scaling (Float8CurrentScaling): one scale per expert for its rows (the input in
  forward, the output gradient in backward) and one for its matrix; a group's amax is found on the
  device (each row's amax, scattered with "amax" into its group), one tensor-wide cast applies them;
- block scaling: 1x128 (Float8BlockScaling) and 1x32 (MXFP8) blocks of the input and output
  gradient run along one row, so all rows are quantized at once; 128x128 weight blocks are cut per
  expert, its rows padded with zeros to whole blocks (zeros change no block's amax), so no block
  straddles two experts whatever N is; the weight gradient multiplies operands transposed, whose
  blocks run along the tokens and must not straddle two groups: each group's transpose is quantized
  on its own, its blocks starting at the group's first row, as the dense linear on that group does.
  So the weight gradient is FP8 for every recipe, exactly to its definition.

Per-tensor scaling of a bf16 model on a GPU whose grouped FP8 kernel works runs all groups in one
``torch._scaled_grouped_mm`` per GEMM, with no group sizes on the host (fsdp8/fp8/grouped_kernel.py,
[Note: FP8 experts in one grouped kernel]; its backward too when the gradients are e4m3). Every other
GEMM runs group by group through gemm.fp8_mm: torch._scaled_mm where the device has a native FP8 GEMM
for the recipe, else the exact emulation (dequantize, then an fp32 matmul, fp64 when the model
computes in fp64). The group sizes are read on the host for that: one synchronisation per layer
(``Groups``, shared by the experts' GEMMs), where the high-precision grouped_mm on CUDA has none.

Under the sharding engine the weight arrives quantized: the engine gathers an FP8 experts
module's weights as 8-bit bytes, each expert quantized on the rank that holds it (per-tensor and
128x128 scales agreed across the ranks, MX scales travelling with the bytes;
fsdp8/engine/fp8_experts.py), and ``weight`` is a 3-D Float8Tensor over them. Its bytes and
scales are those ``grouped_weights`` makes from the high-precision weight, so both GEMMs that
read the weight use them as they are, the transposes made once per gather; the weight gradient
goes to the parameter as before.

Delayed scaling keeps an amax history per expert and operand (fsdp8/fp8/grouped_delayed.py, [Note:
delayed experts]): each expert's rows, matrix and output gradient are quantized with its history's
scales, as the dense delayed linear on its rows: in the grouped kernel where it runs (its backward
too with e4m3 gradients), else group by group; such calls are opaque in compiled blocks.
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F

from . import grouped_kernel
from .formats import E4M3, Granularity, aligned
from .gemm import fp8_mm
from .grouped_delayed import LocalExperts
from .grouped_kernel import Bounds, Groups, group_amax, quantize_experts, quantize_groups
from .kernels import Quantized, quantize, quantize_transposed
from .recipes import G, W, X, Recipe, update_delayed_states
from .grouped_traced import traced_fp8_grouped_mm
from .tensor import Float8Tensor, transpose_of
from .triton_grouped import transpose_bytes

_MARK = "fsdp8_fp8_experts"
# The 3-D weights an FP8 experts forward passes to fp8_grouped_mm (fsdp8.models.moe.experts_forward,
# fsdp8.parallel.ep): those the engine may gather as FP8 bytes.
FP8_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


# -- which experts run in FP8 ----------------------------------------------------------------------
def fp8_experts_forward(forward: Callable) -> Callable:
    """Mark ``forward``, an experts module's forward, as one that computes its expert GEMMs with
    ``fp8_grouped_mm`` when the module carries ``fp8_recipe``: FP8 conversion attaches a recipe only
    to modules whose forward says so (another would keep computing in high precision, silently)."""
    setattr(forward, _MARK, True)
    return forward


def runs_fp8_experts(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is marked by ``fp8_experts_forward``."""
    return bool(getattr(module.forward, _MARK, False))


def probe_before_compiling(model: torch.nn.Module, device: torch.device) -> None:
    """Where ``model`` has FP8 experts on a GPU, run the grouped kernel's probe now, before its units
    are compiled: a compiled unit then traces the experts (grouped_traced.py) from its first call,
    where a probe met inside a trace would split the graph there."""
    if device.type == "cuda" and any(getattr(m, "fp8_recipe", None) is not None and runs_fp8_experts(m)
                                     for m in model.modules()):
        grouped_kernel.kernel_runs(device)


# -- the operands, one Quantized per group ---------------------------------------------------------
def grouped_rows(t: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity, groups: Groups,
                 scale: Optional[torch.Tensor] = None) -> List[Quantized]:
    """Each group's rows of ``t`` [T, K] (contiguous) quantized along K as that group alone would be
    (per tensor: with ``scale`` [G] where given, delayed scaling's)."""
    if granularity is Granularity.TENSOR:
        q = quantize_groups(t, fp8_dtype, groups, scale=scale)
        return split_by_group(q.data, q.inv, groups.bounds())
    q = quantize(t, fp8_dtype, granularity)  # blocks along one row: local to it, hence to its group
    return [Quantized(q.data[a:b], q.scale_inv[a:b], granularity) for a, b in groups.bounds()]


def split_by_group(data: torch.Tensor, inv: torch.Tensor, bounds: Bounds, squeeze: bool = False) -> List[Quantized]:
    """Per-tensor bytes cut into their groups (rows ``a:b``; ``squeeze``: matrix ``a`` of a 3-D
    tensor), each with its 0-d scale on a 16-byte boundary, as torch._scaled_mm takes it."""
    inv = aligned(inv)
    return [Quantized(data[a] if squeeze else data[a:b], inv[g], Granularity.TENSOR) for g, (a, b) in enumerate(bounds)]


def grouped_weights(w: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity,
                    scale: Optional[torch.Tensor] = None) -> List[Quantized]:
    """Each expert's matrix of ``w`` [E, N, K] (contiguous) quantized along K as a dense weight
    (per tensor: with ``scale`` [E] where given, delayed scaling's)."""
    experts, n, k = w.shape
    if granularity is Granularity.TENSOR:
        data, inv = quantize_experts(w, fp8_dtype, scale)
        return split_by_group(data, inv, [(g, g + 1) for g in range(experts)], squeeze=True)
    pad = -n % granularity.block[0]  # 128x128: each expert's rows padded to whole blocks
    padded = F.pad(w, (0, 0, 0, pad)) if pad else w
    q = quantize(padded.reshape(experts * (n + pad), k), fp8_dtype, granularity)
    data = q.data.view(experts, n + pad, k)
    inv = q.scale_inv.view(experts, -1, q.scale_inv.shape[-1])
    return [Quantized(data[g, :n], inv[g], granularity) for g in range(experts)]


def record_delayed_amaxes(delayed: LocalExperts, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> None:
    """Delayed scaling: each group's amax of its rows ``x`` and of its matrix in ``w`` [E, N, K], the
    matrix's only where its expert has rows (an uncalled linear records nothing)."""
    group = groups.row_group(x.shape[0])
    delayed.record(X, group_amax(x, group, w.shape[0]))
    reached = groups.counts() > 0
    amaxes = torch.linalg.vector_norm(w, float("inf"), dim=(1, 2)).float()
    delayed.record(W, torch.where(reached, amaxes, torch.zeros_like(amaxes)))


def _delayed_scale(delayed: Optional[LocalExperts], row: int) -> Optional[torch.Tensor]:
    return None if delayed is None else delayed.scale(row)


def transposed_groups(parts: List[Quantized], t: Optional[torch.Tensor], fp8_dtype: torch.dtype, granularity: Granularity,
                      bounds: Bounds) -> List[Optional[Quantized]]:
    """Each group's rows transposed, [K, rows], quantized along the tokens: the weight gradient's
    operands (None for an empty group). Per tensor, the group's bytes transposed (the same scale
    reads them either way); blocks are quantized again from ``t``, group by group, so that none
    straddles two groups."""
    if granularity is Granularity.TENSOR:
        return [q.t().contiguous() if b > a else None for q, (a, b) in zip(parts, bounds)]
    return [quantize_transposed(t[a:b], fp8_dtype, granularity) if b > a else None for a, b in bounds]


# -- the GEMMs -------------------------------------------------------------------------------------
def rows_times_groups(qa: List[Quantized], qb: List[Quantized], cols: int, dtype: torch.dtype, recipe: Recipe,
                      device: torch.device, fast_accum: bool = False) -> torch.Tensor:
    """Group g's rows of ``qa`` times ``qb[g]``.T, stacked by group: [T, cols]."""
    parts = [fp8_mm(a, b, dtype, recipe, fast_accum) for a, b in zip(qa, qb) if a.shape[0]]
    return torch.cat(parts) if parts else torch.zeros(0, cols, dtype=dtype, device=device)


def per_group_products(qa_t: List[Optional[Quantized]], qb_t: List[Optional[Quantized]], shape, dtype: torch.dtype,
                       recipe: Recipe, device: torch.device) -> torch.Tensor:
    """[G, N, K]: group g's ``a`` [rows, N] transposed times its ``b`` [rows, K], from their
    transposes quantized along the tokens; zero for an empty group."""
    zero = torch.zeros(shape, dtype=dtype, device=device)
    return torch.stack([zero if a is None else fp8_mm(a, b, dtype, recipe) for a, b in zip(qa_t, qb_t)])


def one_kernel(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, recipe: Recipe) -> bool:
    """Whether this call's GEMMs run as one grouped kernel each ([Note: FP8 experts in one grouped
    kernel]): per-tensor scales, a bf16 model, dims and offsets the kernel takes, a device where it works."""
    per_tensor = all(g is Granularity.TENSOR for g in (recipe.x_granularity, recipe.w_granularity, recipe.g_granularity))
    return (per_tensor and x.dtype == torch.bfloat16 and offs.dtype == torch.int32 and x.shape[1] % 16 == 0
            and weight.shape[1] % 16 == 0 and grouped_kernel.kernel_runs(x.device))


class Fp8GroupedMm(torch.autograd.Function):
    """out = rows of group g of x times weight[g].T, its three GEMMs in FP8 (see [Note: FP8 experts]).
    Saved for backward: the operands' FP8 bytes and scales (the input only where the weight's
    gradient reads it), never their high-precision values."""

    @staticmethod
    def forward(ctx, x, weight, recipe: Recipe, groups: Groups, grad_enabled: bool, delayed=None):
        dtype = x.dtype
        x = x.detach().contiguous()
        gathered = isinstance(weight, Float8Tensor)  # the engine's bytes (see the Note), checked by the caller
        ctx.groups, ctx.recipe, ctx.dtype, ctx.weight_dtype, ctx.k = groups, recipe, dtype, weight.dtype, x.shape[1]
        ctx.gathered = weight if gathered else None  # its transposes are made once per gather
        ctx.delayed = delayed
        ctx.one_kernel = one_kernel(x, weight, groups.offs, recipe)
        if ctx.one_kernel and grad_enabled and recipe.bwd_dtype != E4M3:
            _warn_hybrid_backward(recipe)
        w = None if gathered else weight.detach().to(dtype).contiguous()
        if delayed is not None:  # the scales of each expert's history, this step's amaxes recorded
            record_delayed_amaxes(delayed, x, w, groups)
        if ctx.one_kernel:
            weight_grad = grad_enabled and ctx.needs_input_grad[1]
            # The weight gradient's operand (the bytes in the padded token buffer) made in the same
            # pass, where the backward will run in the kernel too.
            w, inv_w = (weight._data, weight._scale_inv) if gathered else quantize_experts(w, recipe.fwd_dtype,
                                                                                           _delayed_scale(delayed, W))
            out, qx = grouped_kernel.forward_in_kernel(x, w, inv_w, groups, padded=weight_grad and recipe.bwd_dtype == E4M3,
                                                       scale=_delayed_scale(delayed, X))
            # Kept for backward: the input only where the weight's gradient reads it, and then as
            # that GEMM reads it (in the kernel: the padded buffer alone).
            kept = None if not weight_grad else qx if qx.padded_t is None else qx._replace(data=None, row_inv=None)
            ctx.kernel_operands = (kept, w, inv_w)
            return out
        qx = grouped_rows(x, recipe.fwd_dtype, recipe.x_granularity, groups, _delayed_scale(delayed, X))
        qw = weight.matrices() if gathered else grouped_weights(w, recipe.fwd_dtype, recipe.w_granularity,
                                                                _delayed_scale(delayed, W))
        out = rows_times_groups(qx, qw, weight.shape[1], dtype, recipe, x.device, fast_accum=True)
        ctx.qx_t = transposed_groups(qx, x, recipe.fwd_dtype, recipe.x_granularity, groups.bounds())
        ctx.qw = qw
        return out

    @staticmethod
    def backward(ctx, dy):
        recipe, dtype = ctx.recipe, ctx.dtype
        dy = dy.contiguous().to(dtype)
        if ctx.one_kernel and recipe.bwd_dtype == E4M3:
            dx, dw = _backward_in_one_kernel(ctx, dy)
        else:
            dx, dw = _backward_by_group(ctx, dy)
        ctx.qx_t = ctx.qw = ctx.gathered = ctx.kernel_operands = ctx.delayed = None
        return dx, None if dw is None else dw.to(ctx.weight_dtype), None, None, None, None


def _backward_in_one_kernel(ctx, dy: torch.Tensor):
    qx, w, inv_w = ctx.kernel_operands
    w_t = None
    if ctx.needs_input_grad[0]:
        w_t = ctx.gathered.transposed_bytes() if ctx.gathered is not None else transpose_bytes(w)
    _record_gradient_amaxes(ctx.delayed, dy, ctx.groups)
    return grouped_kernel.backward_in_kernel(dy, w_t, inv_w, ctx.groups, qx, ctx.needs_input_grad[0],
                                             ctx.needs_input_grad[1], scale=_delayed_scale(ctx.delayed, G))


def _record_gradient_amaxes(delayed: Optional[LocalExperts], dy: torch.Tensor, groups: Groups) -> None:
    if delayed is not None:
        delayed.record(G, group_amax(dy, groups.row_group(dy.shape[0]), groups.offs.shape[0]))


def _backward_by_group(ctx, dy: torch.Tensor):
    """dx and dW group by group (after a forward either way: the one-kernel forward's bytes are
    the per-group operands' bytes, cut by the groups' bounds)."""
    recipe, dtype = ctx.recipe, ctx.dtype
    bounds = ctx.groups.bounds()
    if ctx.one_kernel:  # hybrid gradients: e5m2, which the grouped kernel does not take
        qx, w, inv_w = ctx.kernel_operands
        if qx is not None:
            ctx.qx_t = transposed_groups(split_by_group(qx.data, qx.inv, bounds), None, recipe.fwd_dtype,
                                         Granularity.TENSOR, bounds)
        ctx.qw = split_by_group(w, inv_w, [(g, g + 1) for g in range(w.shape[0])], squeeze=True)
    _record_gradient_amaxes(ctx.delayed, dy, ctx.groups)
    qdy = grouped_rows(dy, recipe.bwd_dtype, recipe.g_granularity, ctx.groups, _delayed_scale(ctx.delayed, G))
    dx = dw = None
    if ctx.needs_input_grad[0]:
        gathered = ctx.gathered
        qw_t = gathered.transposed_matrices() if gathered is not None else [transpose_of(q) for q in ctx.qw]
        dx = rows_times_groups(qdy, qw_t, ctx.k, dtype, recipe, dy.device)
    if ctx.needs_input_grad[1]:
        qdy_t = transposed_groups(qdy, dy, recipe.bwd_dtype, recipe.g_granularity, bounds)
        dw = per_group_products(qdy_t, ctx.qx_t, (dy.shape[1], ctx.k), dtype, recipe, dy.device)
    return dx, dw


_WARNED_HYBRID = []


def _warn_hybrid_backward(recipe: Recipe) -> None:
    """Once per process: e5m2 gradients keep the experts' backward GEMMs group by group."""
    if not _WARNED_HYBRID:
        _WARNED_HYBRID.append(True)
        warnings.warn(f"fsdp8: FP8 experts under {type(recipe).__name__}(fp8_format={recipe.fp8_format!r}) run their "
                      "forward in one grouped FP8 kernel but their backward expert by expert (the kernel takes e4m3 "
                      "operands only; these gradients are e5m2), several times slower; "
                      f"{type(recipe).__name__}(fp8_format='e4m3') runs the backward in the kernel too", RuntimeWarning,
                      stacklevel=3)


def _check_gathered(weight: Float8Tensor, recipe: Recipe) -> None:
    if weight._granularity is not recipe.w_granularity or weight._data.dtype != recipe.fwd_dtype:
        raise ValueError(f"fp8_grouped_mm got a weight gathered as {weight._data.dtype} with "
                         f"{weight._granularity.value} scales, but the recipe quantizes weights to {recipe.fwd_dtype} with "
                         f"{recipe.w_granularity.value} scales; shard the model with the experts' recipe")


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, recipe: Recipe,
                   groups: Union[Bounds, Groups, None] = None, delayed: Optional[LocalExperts] = None) -> torch.Tensor:
    """``grouped_mm`` in FP8 under ``recipe``: the rows of group g of ``x`` [T, K] times
    ``weight[g]``.T for ``weight`` [G, N, K] (high precision, or the engine's 3-D Float8Tensor of
    the recipe's bytes and scales), [T, N] in ``x``'s dtype; ``offs`` int32 [G], the
    groups' cumulative row ends (a group may be empty). Each expert is quantized as a dense FP8
    linear on its own rows, with its own scales (see [Note: FP8 experts]). ``groups``: the groups'
    bounds when the caller has them on the host, or a ``Groups`` of ``offs`` that the experts' GEMMs
    share (what is derived from ``offs``, the host read included, made once for them all); None:
    this call's own. ``delayed``: under DelayedScaling, the states of these experts (their
    history's scales are read and this call's amaxes recorded; grouped_delayed.py). In a compiled
    graph the one-kernel path with e4m3 gradients is traced (grouped_traced.py, [Note: FP8
    experts, compiled]); any other is an opaque call."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an fsdp8 FP8 recipe (e.g. Float8CurrentScaling()), got "
                        f"{type(recipe).__name__}")
    if recipe.delayed != (delayed is not None):
        raise ValueError("fp8_grouped_mm takes the experts' delayed-scaling states (delayed=) exactly when the recipe "
                         f"is DelayedScaling; got {type(recipe).__name__} and delayed={delayed!r}. FP8 conversion "
                         "gives an experts module its states (fsdp8.fp8.grouped_delayed)")
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or offs.shape != weight.shape[:1]:
        raise ValueError(f"fp8_grouped_mm takes x [T, K], weight [G, N, K] and offs [G], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(offs.shape)}")
    if isinstance(groups, Groups) and groups.offs is not offs:
        raise ValueError("fp8_grouped_mm got a Groups of other offsets than offs; make it with Groups(offs)")
    if isinstance(weight, Float8Tensor):
        _check_gathered(weight, recipe)
        if delayed is not None:
            raise ValueError("fp8_grouped_mm under delayed scaling quantizes the experts' weights itself, with their "
                             "histories' scales; it got them gathered as FP8 bytes")
    if (torch.compiler.is_compiling() and delayed is None and recipe.bwd_dtype == E4M3
            and one_kernel(x, weight, offs, recipe)):
        return traced_fp8_grouped_mm(x, weight, offs)
    return _opaque_grouped_mm(x, weight, offs, recipe, groups, delayed)


@torch.compiler.disable  # group sizes may be read on the host: an opaque call in compiled blocks
def _opaque_grouped_mm(x, weight, offs, recipe: Recipe, groups, delayed: Optional[LocalExperts] = None) -> torch.Tensor:
    if not isinstance(groups, Groups):
        groups = Groups(offs, groups)
    if delayed is not None and not delayed.experts.external_update and delayed.experts.dirty:
        # Standalone use: fold the last step's amaxes in, as a standalone delayed Float8Linear does.
        update_delayed_states(delayed.experts.states)
        delayed.experts.dirty = False
    return Fp8GroupedMm.apply(x, weight, recipe, groups, torch.is_grad_enabled(), delayed)
