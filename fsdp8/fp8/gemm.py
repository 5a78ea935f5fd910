"""The FP8 GEMM and its operands: ``fp8_mm`` (torch._scaled_mm where the device has a native
FP8 GEMM for the recipe, emulated elsewhere with identical quantization) and the helpers that
quantize a linear's input, weight and output gradient for it, tensor-parallel pieces included
(scales agreed over tp; a sequence-sharded input is gathered as FP8 bytes in tp_gather.py). Float8Linear
(linear_fn.py), the fused SwiGLU MLP (mlp.py) and the tensor-parallel forward (tp_forward.py)
all compute through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import comm
from .formats import Granularity, amax_to_scale, scale_inv_to_e8m0
from .kernels import Quantized, amax, cast_transpose, quantize, quantize_1x128_both_ways, quantize_transposed
from .recipes import W, X, DelayedBuffers, DelayedState, Recipe
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


def native_ok(a: Quantized, b: Quantized, recipe: Recipe, out_dtype: torch.dtype) -> bool:
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
    if a.granularity is Granularity.ROW_1x128 and m % 4:
        # The 1x128 scales go outer-major (a stride of m floats), which cuBLAS also wants
        # 16-byte aligned: an expert's group of rows can have any count.
        return False
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
    if not native_ok(a, b, recipe, out_dtype):
        # Emulation: exact dequantization, then one matmul (bf16 for MX on CUDA, as the native
        # MX GEMM writes: power-of-two scales keep the dequantized values exact in bf16; fp32
        # otherwise, as the FP8 GEMMs accumulate). A model computing in fp64 gets fp64 products
        # on every device and recipe, each of two dequantized
        # FP8 values nearly exact, so its result does not depend on the order of the sum (a
        # compiled graph or another BLAS kernel gives the same bytes: the compiled-block tests
        # run so, where an fp32 ulp of difference could flip an FP8 byte downstream).
        if out_dtype == torch.float64:
            dtype = torch.float64
        elif a.data.is_cuda and a.granularity is Granularity.MX_1x32:
            dtype = torch.bfloat16  # as the native MX GEMM, which writes bf16
        else:
            dtype = torch.float32
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


# -- tensor parallelism ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorParallelGemm:
    """Where a Float8Linear's operands are tensor-parallel shards (tp_forward.py decides).

    Per-tensor scales of a shard are agreed over ``group`` (a max all-reduce of its amax), so
    each rank quantizes its piece exactly as one process would quantize the whole tensor.
    With ``gathered`` the input arrived sequence-sharded and was gathered as FP8 bytes
    (tp_gather.py): the linear computes with those operands, and its input is the gather's
    placeholder, which takes the full-length input gradient (reduce-scattered there)."""

    group: object
    x_sharded: bool = False  # rowwise: the input's last (reduction) dim is split over tp
    w_sharded: bool = True
    dy_sharded: bool = False  # colwise: the output's last dim is split over tp
    gathered: Optional[Tuple[Quantized, Quantized]] = None  # the input and its transpose

    def amax_group(self, sharded: bool):
        return self.group if sharded else None


def group_scale(t: torch.Tensor, fp8_dtype, group) -> torch.Tensor:
    """The per-tensor scale of the whole tensor of which ``t`` is this rank's piece. ``group``: None
    (``t`` is whole), a ProcessGroup (eager), or the 1-D tp DeviceMesh of a linear traced into a compiled graph
    (tp_forward.py [Note: FP8 under TP, compiled]), agreed with a functional collective."""
    t_amax = amax(t)
    if isinstance(group, DeviceMesh):
        t_amax = comm.maxed(t_amax, group)
    elif group is not None:
        comm.all_reduce(t_amax, group, dist.ReduceOp.MAX, "fp8 tensor-parallel amax")
    return amax_to_scale(t_amax, fp8_dtype)


# -- quantizing the three operands ---------------------------------------------------------------
def quantize_both_ways(t: torch.Tensor, granularity: Granularity, fp8_dtype, state: Optional[DelayedState], row: int,
                       group=None):
    """``t`` quantized along its rows and its transpose quantized along *its* rows (a
    per-tensor scale agreed over ``group`` when ``t`` is a tensor-parallel shard)."""
    if granularity is Granularity.TENSOR:
        # Delayed: the scale comes from the history and t's amax out of the same pass.
        if state is not None:
            scale = state.scale[row]
        else:
            scale = group_scale(t, fp8_dtype, group) if group is not None else None
        q, q_t, t_amax, inv = cast_transpose(t, fp8_dtype, scale)
        if state is not None:
            state.record(row, t_amax)
        inv = kept_inverse(state, row, inv)
        return Quantized(q, inv, granularity), Quantized(q_t, inv, granularity)
    if granularity is Granularity.ROW_1x128:
        return quantize_1x128_both_ways(t, fp8_dtype)
    return quantize(t, fp8_dtype, granularity), quantize(t.t(), fp8_dtype, granularity)


def kept_inverse(state, row: int, inverse: torch.Tensor) -> torch.Tensor:
    """In a compiled graph under delayed scaling, the inverse of ``row``'s scale that the state
    keeps (computed with the scale, once a step, bit for bit the same) instead of ``inverse``:
    the compiler then drops the one-element kernel that computed it."""
    if isinstance(state, DelayedBuffers):
        return state.scale_inv[row]
    return inverse


def quantized_input(x: torch.Tensor, x2d: torch.Tensor, recipe: Recipe, state: Optional[DelayedState], group=None):
    """The input in both FP8 layouts. Linears fed the same tensor (q/k/v projections, gate and
    up) share one quantization unless delayed scaling gives each its own scale."""
    if state is not None or group is not None:
        return quantize_both_ways(x2d, recipe.x_granularity, recipe.fwd_dtype, state, X, group)
    key = (x._version, recipe.x_granularity, recipe.fwd_dtype)
    cached = getattr(x, "_fsdp8_fp8_input", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    qx, qx_t = quantize_both_ways(x2d, recipe.x_granularity, recipe.fwd_dtype, None, X)
    x._fsdp8_fp8_input = (key, qx, qx_t)
    return qx, qx_t


def weight_operands(weight, recipe: Recipe, state: Optional[DelayedState], dtype, group=None):
    """The weight (N, K) quantized along K and, when it comes for free, its transpose (K, N);
    an engine-gathered FP8 weight is used as is (its transpose is made once per gather)."""
    if isinstance(weight, Float8Tensor):
        # Read as attributes, not through a method: torch.compile traces them as tensors.
        return Quantized(weight._data, weight._scale_inv, recipe.w_granularity), None
    w = weight.detach().to(dtype)
    if recipe.w_granularity is Granularity.TENSOR:
        return quantize_both_ways(w, Granularity.TENSOR, recipe.fwd_dtype, state, W, group)
    return quantize(w, recipe.fwd_dtype, recipe.w_granularity), None


def weight_transposed(weight, qw: Quantized) -> Quantized:
    """The weight's transpose (K, N) quantized along N, for the input-gradient GEMM (cached on
    an engine weight for the step; a compiled graph makes it where it is used)."""
    if isinstance(weight, Float8Tensor) and not torch.compiler.is_compiling():
        return weight.transposed()
    return transpose_of(qw)


def input_in_graph(x: torch.Tensor, recipe: Recipe, group=None) -> Tuple[Quantized, Optional[torch.Tensor]]:
    """In a compiled graph, a linear's input quantized along its rows, and its per-tensor scale
    (agreed over the tp mesh ``group`` when the input is a tensor-parallel piece), which backward
    reuses for the transpose (``input_transposed``). See Float8Linear.forward for why this
    happens outside the linear's autograd function."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    x_scale = None
    if recipe.x_granularity is Granularity.TENSOR:
        x_scale = group_scale(x2d, recipe.fwd_dtype, group)
    return quantize(x2d, recipe.fwd_dtype, recipe.x_granularity, x_scale), x_scale


def input_transposed(x: torch.Tensor, recipe: Recipe, scale: Optional[torch.Tensor] = None) -> Quantized:
    """A saved input's transpose quantized for the weight gradient, in backward: the same bytes
    and scales as quantizing both ways in forward (compiled graphs save the input, not FP8)."""
    return quantize_transposed(x.detach().reshape(-1, x.shape[-1]), recipe.fwd_dtype, recipe.x_granularity, scale)
