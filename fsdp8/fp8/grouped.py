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

Every GEMM then runs group by group through gemm.fp8_mm: torch._scaled_mm where the device has a
native FP8 GEMM for the recipe, else the exact emulation (dequantize, then an fp32 matmul, fp64 when
the model computes in fp64). The group sizes are read on the host for that: one synchronisation per
call, where the high-precision grouped_mm on CUDA has none. One native grouped kernel
(torch._scaled_grouped_mm) would drop it and the per-group launches; it is not used yet.

Under the sharding engine the weight arrives quantized: the engine gathers an FP8 experts
module's weights as 8-bit bytes, each expert quantized on the rank that holds it (per-tensor and
128x128 scales agreed across the ranks, MX scales travelling with the bytes;
fsdp8/engine/fp8_experts.py), and ``weight`` is a 3-D Float8Tensor over them. Its bytes and
scales are those ``grouped_weights`` makes from the high-precision weight, so both GEMMs that
read the weight use them as they are, the transposes made once per gather; the weight gradient
goes to the parameter as before.

Not here: delayed scaling (per-expert amax histories agreed across ranks, which fsdp8 does not keep;
conversion leaves experts in high precision under it and says so), and tracing by torch.compile (an
opaque call inside a compiled block).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .formats import Granularity, aligned, amax_to_scale, scale_to_inv
from .gemm import fp8_mm
from .kernels import Quantized, quantize, quantize_transposed, saturate_cast
from .recipes import Recipe
from .tensor import Float8Tensor, transpose_of

_MARK = "fsdp8_fp8_experts"
# The 3-D weights an FP8 experts forward passes to fp8_grouped_mm (fsdp8.models.moe.experts_forward,
# fsdp8.parallel.ep): those the engine may gather as FP8 bytes.
FP8_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")

Bounds = List[Tuple[int, int]]


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


# -- groups ----------------------------------------------------------------------------------------
def bounds_of(ends: List[int]) -> Bounds:
    """(first row, end row) of each group whose end rows (cumulative) are ``ends``."""
    return list(zip([0] + ends[:-1], ends))


def group_bounds(offs: torch.Tensor) -> Bounds:
    """``bounds_of`` the groups' ends ``offs``, read on the host: the call's one synchronisation."""
    return bounds_of(offs.tolist())


def group_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows, on the device (empty groups own no row)."""
    return torch.searchsorted(offs, torch.arange(rows, dtype=offs.dtype, device=offs.device), right=True)


def group_amax(t: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """The largest magnitude of each group's rows of ``t`` [T, K] (fp32 [groups]; 0 for an empty
    group, NaN propagates), without a host synchronisation."""
    rows = t.detach().abs().amax(dim=1).float()
    return torch.zeros(groups, dtype=torch.float32, device=t.device).scatter_reduce_(0, group, rows, "amax")


# -- the operands, one Quantized per group ---------------------------------------------------------
def grouped_rows(t: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity, offs: torch.Tensor,
                 bounds: Bounds) -> List[Quantized]:
    """Each group's rows of ``t`` [T, K] (contiguous) quantized along K as that group alone would be."""
    if granularity is Granularity.TENSOR:
        group = group_of_rows(offs, t.shape[0])
        scale = amax_to_scale(group_amax(t, group, len(bounds)), fp8_dtype)
        data = saturate_cast(t, scale[group][:, None], fp8_dtype)
        inv = aligned(scale_to_inv(scale))
        return [Quantized(data[a:b], inv[g], granularity) for g, (a, b) in enumerate(bounds)]
    q = quantize(t, fp8_dtype, granularity)  # blocks along one row: local to it, hence to its group
    return [Quantized(q.data[a:b], q.scale_inv[a:b], granularity) for a, b in bounds]


def grouped_weights(w: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity) -> List[Quantized]:
    """Each expert's matrix of ``w`` [E, N, K] (contiguous) quantized along K as a dense weight."""
    experts, n, k = w.shape
    if granularity is Granularity.TENSOR:
        scale = amax_to_scale(w.abs().amax(dim=(1, 2)).float(), fp8_dtype)
        data = saturate_cast(w, scale[:, None, None], fp8_dtype)
        inv = aligned(scale_to_inv(scale))
        return [Quantized(data[g], inv[g], granularity) for g in range(experts)]
    pad = -n % granularity.block[0]  # 128x128: each expert's rows padded to whole blocks
    padded = F.pad(w, (0, 0, 0, pad)) if pad else w
    q = quantize(padded.reshape(experts * (n + pad), k), fp8_dtype, granularity)
    data = q.data.view(experts, n + pad, k)
    inv = q.scale_inv.view(experts, -1, q.scale_inv.shape[-1])
    return [Quantized(data[g, :n], inv[g], granularity) for g in range(experts)]


def transposed_groups(parts: List[Quantized], t: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity,
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


class Fp8GroupedMm(torch.autograd.Function):
    """out = rows of group g of x times weight[g].T, its three GEMMs in FP8 (see [Note: FP8 experts]).
    Saved for backward: FP8 bytes only (each group's input transposed, each expert's weight)."""

    @staticmethod
    def forward(ctx, x, weight, offs, recipe: Recipe, bounds: Optional[Bounds]):
        dtype = x.dtype
        bounds = bounds if bounds is not None else group_bounds(offs)
        x = x.detach().contiguous()
        qx = grouped_rows(x, recipe.fwd_dtype, recipe.x_granularity, offs, bounds)
        gathered = isinstance(weight, Float8Tensor)  # the engine's bytes (see the Note)
        if gathered:
            _check_gathered(weight, recipe)
            qw = weight.matrices()
        else:
            qw = grouped_weights(weight.detach().to(dtype).contiguous(), recipe.fwd_dtype, recipe.w_granularity)
        out = rows_times_groups(qx, qw, weight.shape[1], dtype, recipe, x.device, fast_accum=True)
        ctx.qx_t = transposed_groups(qx, x, recipe.fwd_dtype, recipe.x_granularity, bounds)
        ctx.qw, ctx.offs, ctx.bounds, ctx.recipe = qw, offs, bounds, recipe
        ctx.gathered = weight if gathered else None  # its transposes are made once per gather
        ctx.dtype, ctx.weight_dtype, ctx.k = dtype, weight.dtype, x.shape[1]
        return out

    @staticmethod
    def backward(ctx, dy):
        recipe, bounds, dtype = ctx.recipe, ctx.bounds, ctx.dtype
        dy = dy.contiguous().to(dtype)
        qdy = grouped_rows(dy, recipe.bwd_dtype, recipe.g_granularity, ctx.offs, bounds)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gathered = ctx.gathered
            qw_t = gathered.transposed_matrices() if gathered is not None else [transpose_of(q) for q in ctx.qw]
            dx = rows_times_groups(qdy, qw_t, ctx.k, dtype, recipe, dy.device)
        if ctx.needs_input_grad[1]:
            qdy_t = transposed_groups(qdy, dy, recipe.bwd_dtype, recipe.g_granularity, bounds)
            dw = per_group_products(qdy_t, ctx.qx_t, (dy.shape[1], ctx.k), dtype, recipe, dy.device)
            dw = dw.to(ctx.weight_dtype)
        ctx.qx_t = ctx.qw = ctx.gathered = None
        return dx, dw, None, None, None


def _check_gathered(weight: Float8Tensor, recipe: Recipe) -> None:
    if weight._granularity is not recipe.w_granularity or weight._data.dtype != recipe.fwd_dtype:
        raise ValueError(f"fp8_grouped_mm got a weight gathered as {weight._data.dtype} with "
                         f"{weight._granularity.value} scales, but the recipe quantizes weights to {recipe.fwd_dtype} with "
                         f"{recipe.w_granularity.value} scales; shard the model with the experts' recipe")


@torch.compiler.disable  # group sizes on the host and per-group GEMMs: an opaque call in compiled blocks
def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, recipe: Recipe,
                   bounds: Optional[Bounds] = None) -> torch.Tensor:
    """``grouped_mm`` in FP8 under ``recipe``: the rows of group g of ``x`` [T, K] times
    ``weight[g]``.T for ``weight`` [G, N, K] (high precision, or the engine's 3-D Float8Tensor of
    the recipe's bytes and scales), [T, N] in ``x``'s dtype; ``offs`` int32 [G], the
    groups' cumulative row ends (a group may be empty). Each expert is quantized as a dense FP8
    linear on its own rows, with its own scales (see [Note: FP8 experts]). ``bounds``:
    ``group_bounds(offs)`` when the caller has them (the experts' two GEMMs share one host read)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an fsdp8 FP8 recipe (e.g. Float8CurrentScaling()), got "
                        f"{type(recipe).__name__}")
    if recipe.delayed:
        raise ValueError("fp8_grouped_mm has no delayed scaling (it would need per-expert amax histories); use "
                         "Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling for FP8 experts")
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or offs.shape != weight.shape[:1]:
        raise ValueError(f"fp8_grouped_mm takes x [T, K], weight [G, N, K] and offs [G], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(offs.shape)}")
    return Fp8GroupedMm.apply(x, weight, offs, recipe, bounds)
