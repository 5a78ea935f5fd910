"""FP8 linear: the three GEMMs (out, dgrad, wgrad) through torch._scaled_mm, emulated where
the device has no native FP8 GEMM for the recipe (the quantization is identical)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .formats import Granularity, amax_to_scale, scale_inv_to_e8m0
from .kernels import Quantized, amax, cast_transpose, quantize, quantize_1x128_both_ways, quantize_transposed
from .recipes import G, W, X, DelayedBuffers, DelayedState, Recipe, record_amax, update_delayed_states
from .tensor import Float8Tensor, transpose_of


# -- GEMM --------------------------------------------------------------------------------------
def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS wants 1x128 scales stored outer-dimension-major (column-major)."""
    return scale.t().contiguous().t()


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """MX scales in the tiled layout cuBLAS reads on sm100: 128x4 tiles, each split into
    four 32x4 column groups stored side by side."""
    rows, cols = scale.shape
    r_blocks, c_blocks = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(r_blocks * 128, c_blocks * 4, dtype=scale.dtype, device=scale.device)
    padded[:rows, :cols] = scale
    tiles = padded.view(r_blocks, 128, c_blocks, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


# What cuBLAS's FP8 GEMMs write; a model computing in fp64 takes the emulation (see fp8_mm).
_NATIVE_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native_ok(a: Quantized, b: Quantized, recipe: Recipe, out_dtype: torch.dtype) -> bool:
    if not (a.data.is_cuda and recipe.native_gemm(a.data.device)) or out_dtype not in _NATIVE_OUT_DTYPES:
        return False
    m, k = a.shape
    n = b.shape[0]
    if k % 16 or n % 16:
        return False
    pair = (a.granularity, b.granularity)
    if Granularity.MX_1x32 in pair:
        return pair == (Granularity.MX_1x32, Granularity.MX_1x32) and k % 32 == 0
    if pair == (Granularity.TENSOR, Granularity.TENSOR):
        return not (a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2)
    if pair == (Granularity.ROW_1x128, Granularity.BLOCK_128x128) and (k // 128) % 4:
        return False  # cuBLAS wants 16-byte aligned strides for the 128x128 scale grid
    return k % 128 == 0 and pair in (
        (Granularity.ROW_1x128, Granularity.BLOCK_128x128),
        (Granularity.ROW_1x128, Granularity.ROW_1x128),
    )


def fp8_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, recipe: Recipe, fast_accum: bool = False) -> torch.Tensor:
    """``a @ b.T`` for row-major ``a`` (M, K) and ``b`` (N, K), both quantized along K."""
    if not (a.data.is_contiguous() and b.data.is_contiguous()):
        # cuBLAS needs exactly this layout; checked on every path so CPU runs catch a slip too.
        raise ValueError(f"fp8_mm takes row-major (contiguous) operands, got strides {a.data.stride()} and "
                         f"{b.data.stride()}")
    if not _native_ok(a, b, recipe, out_dtype):
        # Emulation: exact dequantization, then one matmul (bf16 for MX on CUDA: power-of-two
        # scales keep the dequantized values exact in bf16; fp32 otherwise, as the FP8 GEMMs
        # accumulate). A model computing in fp64 gets fp64 products, each of two dequantized
        # FP8 values nearly exact, so its result does not depend on the order of the sum (a
        # compiled graph or another BLAS kernel gives the same bytes: the compiled-block tests
        # run so, where an fp32 ulp of difference could flip an FP8 byte downstream).
        if a.data.is_cuda and a.granularity is Granularity.MX_1x32:
            dtype = torch.bfloat16
        else:
            dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
        return (a.dequantize(dtype) @ b.dequantize(dtype).t()).to(out_dtype)
    mat_b = b.data.t()  # column-major (K, N) view of the row-major (N, K) operand
    if a.granularity is Granularity.TENSOR:
        return torch._scaled_mm(a.data, mat_b, a.scale_inv, b.scale_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if a.granularity is Granularity.MX_1x32:
        scale_a = to_blocked(_e8m0(a.scale_inv))
        scale_b = to_blocked(_e8m0(b.scale_inv))
        return torch._scaled_mm(a.data, mat_b, scale_a, scale_b, out_dtype=torch.bfloat16).to(out_dtype)
    if b.granularity is Granularity.BLOCK_128x128:
        scale_b = _outer_major(b.scale_inv.t())  # (K/128, N/128), K-block stride 1
    else:
        scale_b = b.scale_inv.t().contiguous()  # (K/128, N), N stride 1
    out = torch._scaled_mm(a.data, mat_b, _outer_major(a.scale_inv), scale_b, out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def _e8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    return scale_inv_to_e8m0(scale_inv).view(torch.float8_e8m0fnu)


# -- tensor parallelism -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorParallelGemm:
    """Where a Float8Linear's operands are tensor-parallel shards (fp8/tp.py decides).

    Per-tensor scales of a shard are agreed over ``group`` (a max all-reduce of its amax), so
    each rank quantizes its piece exactly as one process would quantize the whole tensor.
    With ``gather_dim`` the input arrives sequence-sharded: it is quantized, its FP8 bytes
    are all-gathered along that dim, and the input gradient is reduce-scattered back."""

    group: object
    x_sharded: bool = False  # rowwise: the input's last (reduction) dim is split over tp
    w_sharded: bool = True
    dy_sharded: bool = False  # colwise: the output's last dim is split over tp
    gather_dim: Optional[int] = None

    def amax_group(self, sharded: bool):
        return self.group if sharded else None


def _group_scale(t: torch.Tensor, fp8_dtype, group) -> torch.Tensor:
    """The per-tensor scale of the whole tensor of which ``t`` is this rank's piece."""
    t_amax = amax(t)
    dist.all_reduce(t_amax, op=dist.ReduceOp.MAX, group=group)
    return amax_to_scale(t_amax, fp8_dtype)


# -- quantizing the three operands ---------------------------------------------------------------
def _quantize_both_ways(t: torch.Tensor, granularity: Granularity, fp8_dtype, state: Optional[DelayedState], row: int,
                        group=None):
    """``t`` quantized along its rows and its transpose quantized along *its* rows (a
    per-tensor scale agreed over ``group`` when ``t`` is a tensor-parallel shard)."""
    if granularity is Granularity.TENSOR:
        # Delayed: the scale comes from the history and t's amax out of the same pass.
        scale = state.scale[row] if state is not None else (_group_scale(t, fp8_dtype, group) if group else None)
        q, q_t, t_amax, inv = cast_transpose(t, fp8_dtype, scale)
        if state is not None:
            state.record(row, t_amax)
        inv = _kept_inverse(state, row, inv)
        return Quantized(q, inv, granularity), Quantized(q_t, inv, granularity)
    if granularity is Granularity.ROW_1x128:
        return quantize_1x128_both_ways(t, fp8_dtype)
    return quantize(t, fp8_dtype, granularity), quantize(t.t(), fp8_dtype, granularity)


def _kept_inverse(state, row: int, inverse: torch.Tensor) -> torch.Tensor:
    """In a compiled graph under delayed scaling, the inverse of ``row``'s scale that the state
    keeps (computed with the scale, once a step, bit for bit the same) instead of ``inverse``:
    the compiler then drops the one-element kernel that computed it."""
    if isinstance(state, DelayedBuffers):
        return state.scale_inv[row]
    return inverse


def _quantized_input(x: torch.Tensor, x2d: torch.Tensor, recipe: Recipe, state: Optional[DelayedState], group=None):
    """The input in both FP8 layouts. Linears fed the same tensor (q/k/v projections, gate and
    up) share one quantization unless delayed scaling gives each its own scale."""
    if state is not None or group is not None:
        return _quantize_both_ways(x2d, recipe.x_granularity, recipe.fwd_dtype, state, X, group)
    key = (x._version, recipe.x_granularity, recipe.fwd_dtype)
    cached = getattr(x, "_fsdp8_fp8_input", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    qx, qx_t = _quantize_both_ways(x2d, recipe.x_granularity, recipe.fwd_dtype, None, X)
    x._fsdp8_fp8_input = (key, qx, qx_t)
    return qx, qx_t


def _weight_operands(weight, recipe: Recipe, state: Optional[DelayedState], dtype, group=None):
    """The weight (N, K) quantized along K and, when it comes for free, its transpose (K, N);
    an engine-gathered FP8 weight is used as is (its transpose is made once per gather)."""
    if isinstance(weight, Float8Tensor):
        # Read as attributes, not through a method: torch.compile traces them as tensors.
        return Quantized(weight._data, weight._scale_inv, recipe.w_granularity), None
    w = weight.detach().to(dtype)
    if recipe.w_granularity is Granularity.TENSOR:
        return _quantize_both_ways(w, Granularity.TENSOR, recipe.fwd_dtype, state, W, group)
    return quantize(w, recipe.fwd_dtype, recipe.w_granularity), None


def _weight_transposed(weight, qw: Quantized) -> Quantized:
    """The weight's transpose (K, N) quantized along N, for the input-gradient GEMM (cached on
    an engine weight for the step; a compiled graph makes it where it is used)."""
    if isinstance(weight, Float8Tensor) and not torch.compiler.is_compiling():
        return weight.transposed()
    return transpose_of(qw)


def input_transposed(x: torch.Tensor, recipe: Recipe, scale: Optional[torch.Tensor] = None) -> Quantized:
    """A saved input's transpose quantized for the weight gradient, in backward: the same bytes
    and scales as quantizing both ways in forward (compiled graphs save the input, not FP8)."""
    return quantize_transposed(x.detach().reshape(-1, x.shape[-1]), recipe.fwd_dtype, recipe.x_granularity, scale)


class _Float8LinearFn(torch.autograd.Function):
    """out = x @ w.T (+ bias) with FP8 GEMMs. Takes only tensors, the (frozen) recipe and the
    delayed-scaling state, so torch.compile can trace it when ``state`` is None: a compiled
    graph passes delayed scaling's scale and pending buffers instead (``delayed_scale``,
    ``delayed_pending``), which it reads and updates in place, in forward and in backward,
    and the scales' kept inverses (``delayed_scale_inv``); under current scaling it passes the
    input's per-tensor scale (``x_scale``) for the backward's transposed quantization."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe, state: Optional[DelayedState], qx_data=None, qx_scale_inv=None,
                tp: Optional[TensorParallelGemm] = None, delayed_scale=None, delayed_pending=None, x_scale=None,
                delayed_scale_inv=None):
        if delayed_pending is not None:
            state = DelayedBuffers(delayed_scale, delayed_pending, delayed_scale_inv)
        x2d = x.reshape(-1, x.shape[-1])
        compute_dtype = x.dtype
        x_shape = x.shape
        qw, qw_t = _weight_operands(weight, recipe, state, compute_dtype, tp.amax_group(tp.w_sharded) if tp else None)
        if tp is not None and tp.gather_dim is not None:
            (qx, qx_t), x_shape = _gathered_input(x, recipe, state, tp), _gathered_shape(x.shape, tp)
            saved_x = None
        elif qx_data is not None:
            # Compiled graphs (see Float8Linear.forward): quantized by the caller; backward
            # quantizes the input's transpose again from the input itself.
            qx, qx_t, saved_x = Quantized(qx_data, qx_scale_inv, recipe.x_granularity), None, x
        else:
            # Eager: saved for backward are FP8 only (the input's transpose and the weight).
            group = tp.amax_group(tp.x_sharded) if tp else None
            (qx, qx_t), saved_x = _quantized_input(x, x2d, recipe, state, group), None
        out = fp8_mm(qx, qw, compute_dtype, recipe, fast_accum=True)
        if bias is not None:
            out = out + bias.to(compute_dtype)
        ctx.qx_t, ctx.x, ctx.qw, ctx.qw_t, ctx.weight = qx_t, saved_x, qw, qw_t, weight
        ctx.x_scale = x_scale
        ctx.recipe, ctx.state, ctx.tp = recipe, state, tp
        ctx.has_bias, ctx.x_shape, ctx.compute_dtype = bias is not None, x_shape, compute_dtype
        ctx.weight_dtype = weight.dtype
        return out.view(*x_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        recipe = ctx.recipe
        dy2d = dy.reshape(-1, dy.shape[-1]).to(ctx.compute_dtype)
        tp = ctx.tp
        qdy, qdy_t = _quantize_both_ways(dy2d, recipe.g_granularity, recipe.bwd_dtype, ctx.state, G,
                                         tp.amax_group(tp.dy_sharded) if tp else None)
        qw_t = ctx.qw_t if ctx.qw_t is not None else _weight_transposed(ctx.weight, ctx.qw)
        qx_t = ctx.qx_t
        if qx_t is None:
            qx_t = input_transposed(ctx.x, recipe, ctx.state.scale[X] if ctx.state is not None else ctx.x_scale)
            qx_t = Quantized(qx_t.data, _kept_inverse(ctx.state, X, qx_t.scale_inv), qx_t.granularity)
        dx = fp8_mm(qdy, qw_t, ctx.compute_dtype, recipe)
        dw = fp8_mm(qdy_t, qx_t, ctx.compute_dtype, recipe)
        dbias = dy2d.sum(0) if ctx.has_bias else None
        ctx.qx_t = ctx.x = ctx.qw = ctx.qw_t = ctx.weight = ctx.x_scale = None
        dx = dx.view(ctx.x_shape)
        if tp is not None and tp.gather_dim is not None:
            dx = _reduce_scatter_sum(dx, tp.gather_dim, tp.group)
        return dx, dw.to(ctx.weight_dtype), dbias, None, None, None, None, None, None, None, None, None


def _gathered_shape(shape, tp: TensorParallelGemm):
    full = list(shape)
    full[tp.gather_dim] *= dist.get_world_size(tp.group)
    return torch.Size(full)


def _gathered_input(x: torch.Tensor, recipe: Recipe, state: Optional[DelayedState], tp: TensorParallelGemm):
    """Sequence parallel: quantize this rank's tokens with the whole input's scale, then
    all-gather the FP8 bytes along the sequence (half the bytes of a bf16 gather). The
    transpose for the weight-gradient GEMM is a transposed copy of the gathered bytes, exact
    for a per-tensor scale, so no high-precision copy of the whole input ever exists."""
    from ..distributed import comm

    x2d = x.detach().reshape(-1, x.shape[-1])
    if state is not None:
        scale = state.scale[X]
        state.record(X, amax(x2d))  # this rank's amax; the engine's step all-reduce takes the max
    else:
        scale = _group_scale(x2d, recipe.fwd_dtype, tp.group)
    q = quantize(x2d, recipe.fwd_dtype, Granularity.TENSOR, scale)
    ranks = dist.get_world_size(tp.group)
    local = q.data.view(torch.uint8).reshape(-1)
    gathered = torch.empty(ranks * local.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered, local, tp.group, "fp8 sequence-parallel input")
    full = gathered.view((ranks,) + tuple(x.shape)).movedim(0, tp.gather_dim).reshape(_gathered_shape(x.shape, tp)).reshape(-1, x.shape[-1])
    qx = Quantized(full.view(recipe.fwd_dtype), q.scale_inv, Granularity.TENSOR)
    return qx, qx.t().contiguous()


def _reduce_scatter_sum(dx: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The input gradient's partial sums over tp, summed and cut back to this rank's tokens."""
    from ..distributed import comm

    ranks = dist.get_world_size(group)
    shape = list(dx.shape)
    shape[dim : dim + 1] = [ranks, shape[dim] // ranks]
    pieces = dx.reshape(shape).movedim(dim, 0).contiguous()
    if ranks == 1:
        return pieces[0]
    out = torch.empty(pieces[0].numel(), dtype=dx.dtype, device=dx.device)
    comm.reduce_scatter_single_fn()(out, pieces.view(-1), op=dist.ReduceOp.SUM, group=group)
    return out.view(pieces.shape[1:])


_FLOAT8_CLASSES: dict = {}


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 under ``recipe`` (see fsdp8.fp8.recipes)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: Optional[Recipe] = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if recipe is None:
            raise ValueError("Float8Linear needs a recipe, e.g. fsdp8.Float8CurrentScaling()")
        self.recipe = recipe
        self._delayed: Optional[DelayedState] = None
        # Under fully_shard, the engine batches delayed-scaling updates across all linears.
        self.external_delayed_update = False
        # Under torch FSDP1 (prepare_fp8_modules_for_fsdp): where delayed amaxes are reduced.
        self.amax_reduction_group = None

    @classmethod
    def convert(cls, linear: nn.Linear, recipe: Recipe) -> "Float8Linear":
        """Turn ``linear`` into a Float8Linear in place (same object, parameters, hooks and
        custom ``reset_parameters``); a subclass of nn.Linear becomes ``Float8<Subclass>``."""
        base = type(linear)
        if not isinstance(linear, Float8Linear):
            if base is not nn.Linear and base not in _FLOAT8_CLASSES:
                _FLOAT8_CLASSES[base] = type(f"Float8{base.__name__}", (cls, base), {})
            linear.__class__ = cls if base is nn.Linear else _FLOAT8_CLASSES[base]
        linear.recipe = recipe
        linear._delayed = None
        linear.external_delayed_update = False
        linear.amax_reduction_group = None
        if recipe.delayed and not linear.weight.is_meta:
            linear.delayed_state(linear.weight.device)
        return linear

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)  # copies into the delayed buffers in place
        if self._delayed is not None:
            self._delayed.refresh_inverses()

    def delayed_state(self, device: torch.device) -> Optional[DelayedState]:
        """The delayed-scaling state (created on first use, on ``device``); its amax history,
        scales and not yet folded-in amaxes are registered as buffers, so checkpoints save and
        restore them and a resumed run scales exactly as an uninterrupted one."""
        if not self.recipe.delayed:
            return None
        if self._delayed is None or self._delayed.history.is_meta:
            self._delayed = DelayedState(self.recipe, device)
            self.register_buffer("fp8_amax_history", self._delayed.history)
            self.register_buffer("fp8_scale", self._delayed.scale)
            self.register_buffer("fp8_amax_pending", self._delayed.pending)
        state = self._delayed
        if state.history is not self.fp8_amax_history:  # the module was moved (.to / .cuda)
            state.history, state.scale, state.pending = self.fp8_amax_history, self.fp8_scale, self.fp8_amax_pending
            state.keep_inverses()
        return state

    def traced(self) -> bool:
        """Whether compiled blocks trace this linear: a traceable recipe, and under delayed
        scaling a state updated outside the block (``external_delayed_update``, as under the
        engine), since a standalone linear decides at each forward, on the host, whether to
        update its state first."""
        return self.recipe.traceable and (not self.recipe.delayed or self.external_delayed_update)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            from .tp import tensor_parallel_forward

            return tensor_parallel_forward(self, x)
        if not self.traced():
            return self._forward_opaque(x)
        state = self.delayed_state(x.device)
        if not torch.compiler.is_compiling():
            return _Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, state)
        # In a compiled block the quantization becomes part of the compiled graph. The input
        # is quantized out here, not inside the autograd function: linears fed the same
        # input (q/k/v, gate/up) then share one quantization once the compiler merges the
        # identical subgraphs (inside separate functions it does not). The function keeps
        # the input itself for backward, not an FP8 copy: the block keeps it (or what it is
        # recomputed from) anyway (a norm's input, the attention output, the MLP's gate and
        # up outputs), so the compiler saves no copy at all, where an FP8 copy per distinct
        # input cost 104 MiB per layer on model B. Backward quantizes it again (same bytes),
        # with a per-tensor scale saved from here: finding it again from the input cost a
        # reduction over every distinct input a layer (docs/PERFORMANCE.md, 2026-11-26 fifth
        # session); block scales of the transpose are other blocks, found in backward.
        x2d = x.detach().reshape(-1, x.shape[-1])
        if state is None:
            x_scale = None
            if self.recipe.x_granularity is Granularity.TENSOR:
                x_scale = amax_to_scale(amax(x2d), self.recipe.fwd_dtype)
            qx = quantize(x2d, self.recipe.fwd_dtype, self.recipe.x_granularity, x_scale)
            return _Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, None, qx.data, qx.scale_inv, None,
                                         None, None, x_scale)
        # [Note: delayed scaling in a compiled block]
        # The scales come from the state's scale buffer and every amax (x here; w in forward
        # and dy in backward inside the function) is folded into its pending buffer with
        # in-place tensor ops. The compiler functionalizes them and writes the buffer back at
        # the end of the forward graph and of the backward graph (AOTAutograd keeps input
        # mutations made in backward, as float8 training needs), so no graph breaks and no
        # host synchronizes; the step's all-reduce and history roll stay outside, in eager.
        # The backward folds dy's amax into the pending value its forward left, so the state
        # must not change in between (the engine's forward-then-backward steps keep to it);
        # autograd checks the buffers' versions and raises if it did (a second forward of the
        # same linear, or a state update, before this one's backward).
        qx = quantize(x2d, self.recipe.fwd_dtype, Granularity.TENSOR, state.scale[X])
        record_amax(state.pending, X, amax(x2d))
        return _Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, None, qx.data, state.scale_inv[X], None,
                                     state.scale, state.pending, None, state.scale_inv)

    @torch.compiler.disable  # an opaque call in compiled blocks (see Float8Linear.traced)
    def _forward_opaque(self, x: torch.Tensor) -> torch.Tensor:
        state = self.delayed_state(x.device)
        if state is not None and not self.external_delayed_update and state.dirty:
            # Standalone use: fold last step's amaxes in (over the FSDP1 group, if given).
            update_delayed_states([state], self.amax_reduction_group)
        return _Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
