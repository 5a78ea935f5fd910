"""Quantize, dequantize, amax and cast+transpose: the torch reference, and Triton on CUDA.

Every function here has one definition of its result, the torch code below: values are
multiplied by the fp32 scale, clamped to the format's range and rounded to nearest-even;
block scales come from the block's amax. ``fsdp8.fp8.triton_kernels`` computes the same bits
faster on CUDA; ``use_triton`` chooses, and the GPU tests compare the two bit for bit. The
engine's weight-shard kernels (agreed scales, packs, amaxes of many weights) are in
weight_kernels.py.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .formats import FP8_MAX, Granularity, amax_to_e8m0, amax_to_scale, e8m0_to_scale_inv, scale_to_inv


@dataclass
class Quantized:
    """A 2-D FP8 tensor and the fp32 ``scale_inv`` that turns it back (one per scaling block)."""

    data: torch.Tensor  # (rows, cols), an FP8 dtype
    scale_inv: torch.Tensor  # [] | (rows, ceil(cols/128)) | (ceil(rows/128), ceil(cols/128)) | (rows, ceil(cols/32))
    granularity: Granularity

    @property
    def shape(self):
        return self.data.shape

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.granularity is Granularity.TENSOR:
            return (fp8_to_float(self.data) * self.scale_inv).to(dtype)
        if self.granularity.block[0] == 1 and self.data.is_contiguous() and use_triton(self.data):
            from . import triton_kernels  # one pass, where the torch code below makes three

            return triton_kernels.dequantize_rows(self.data, self.scale_inv, self.granularity.block[1], dtype)
        # Block by block (a broadcast over the block grid), not through a scale expanded to
        # every element: the same values, and Inductor's CPU code generator handles it.
        rows, cols = self.data.shape
        blocks = _padded_blocks(fp8_to_float(self.data), self.granularity.block)
        values = blocks * self.scale_inv[:, None, :, None]
        return values.reshape(blocks.shape[0] * blocks.shape[1], -1)[:rows, :cols].to(dtype)

    def t(self) -> "Quantized":
        """The transpose (a view). Exact for whole-tensor and 128x128 scaling, whose blocks
        are the same read either way; row blocks are not and must be quantized again."""
        if self.granularity in (Granularity.ROW_1x128, Granularity.MX_1x32):
            raise ValueError(f"{self.granularity.value} blocks run along rows; quantize the transpose instead")
        scale_inv = self.scale_inv if self.granularity is Granularity.TENSOR else self.scale_inv.t()
        return Quantized(self.data.t(), scale_inv, self.granularity)

    def contiguous(self) -> "Quantized":
        return Quantized(self.data.contiguous(), self.scale_inv, self.granularity)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()


@functools.cache
def _fp8_values(fp8_dtype: torch.dtype) -> torch.Tensor:
    """The fp32 value of each of the 256 codes of ``fp8_dtype``, as torch converts them."""
    return torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()


def fp8_to_float(data: torch.Tensor) -> torch.Tensor:
    """``data.float()`` for an FP8 tensor, the same bits. In eager CPU code it reads a table of
    the 256 codes' values: torch's CPU conversion takes ~5 ns an element, about three times the
    lookup (65,536 elements, one thread: 339 against 107 us). The CPU emulation dequantizes both
    operands of every GEMM: a tiny-Llama fp8-current step on one thread took 95 against
    110-121 ms; 100 steps of `fsdp8 train --precision fp8-current` (2 workers) 25-26 against
    26-28 s of training (2026-11-26)."""
    if (data.device.type != "cpu" or torch.compiler.is_compiling() or data.numel() < 1024
            or not data.is_contiguous()):
        # Non-contiguous: .float() keeps the strides, and a matmul may sum in another order
        # for another layout. Under 1,024 elements the lookup's fixed cost is more than it
        # saves (one thread: 256 elements 3.3 against 7.2 us, 1,024 7.0 against 5.5 us).
        return data.float()
    codes = data.view(-1).view(torch.uint8).long()
    return _fp8_values(data.dtype).index_select(0, codes).view(data.shape)


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(x: torch.Tensor, in_graph: bool = False) -> bool:
    """Triton kernels run on CUDA tensors when Triton imports (``FSDP8_TRITON=0`` turns them
    off); everything else uses torch. Under torch.compile the torch code is used too (the
    compiler fuses it into its own kernels, with the neighbouring ops), except where a
    kernel is a graph op (``in_graph``; ``FSDP8_TRITON_OP=0`` turns those off). The kernels
    read 16- and 32-bit floats: fp64 (a model computing in it, as the parity tests do) takes
    torch's path."""
    if not x.is_cuda or x.dtype not in _TRITON_DTYPES or os.environ.get("FSDP8_TRITON", "1") == "0":
        return False
    if torch.compiler.is_compiling() and not (in_graph and os.environ.get("FSDP8_TRITON_OP", "1") != "0"):
        return False
    from . import triton_kernels

    return triton_kernels.available()


# -- helpers ------------------------------------------------------------------------------
def _blocks(shape, block) -> Tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def expand_scale(scale: torch.Tensor, granularity: Granularity, shape) -> torch.Tensor:
    """Broadcast a per-block scale to one value per element of a ``shape`` tensor."""
    if granularity is Granularity.TENSOR:
        return scale
    bm, bk = granularity.block
    return scale.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def _padded_blocks(x: torch.Tensor, block) -> torch.Tensor:
    """``x`` zero-padded to whole blocks and viewed as (row blocks, bm, col blocks, bk)."""
    bm, bk = block
    mb, kb = _blocks(x.shape, block)
    pad_rows, pad_cols = mb * bm - x.shape[0], kb * bk - x.shape[1]
    if pad_rows or pad_cols:
        x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
    return x.reshape(mb, bm, kb, bk)


# -- reference ------------------------------------------------------------------------------
def amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude as an fp32 scalar tensor; NaN propagates. One reduction pass
    (min and max together), no temporary of ``x``'s size. Under torch.compile it is
    ``abs().amax()`` (the same value: both are exact): Inductor lowers aminmax to separate min
    and max reductions, each split in two or three launches and some reading ``x`` twice,
    where one max of the absolute values is one split reduction with ``abs`` fused in
    (docs/PERFORMANCE.md, 2026-11-26 fifth session)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if torch.compiler.is_compiling():
        return x.detach().abs().amax().float()
    low, high = torch.aminmax(x.detach())
    return torch.maximum(low.neg(), high).float()


def block_amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Per-block amax of a 2-D tensor (fp32), shaped like the block grid."""
    if granularity is Granularity.TENSOR:
        return amax(x)
    return _padded_blocks(x.detach().float().abs(), granularity.block).amax(dim=(1, 3))


def saturate_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``round_to_nearest_even(clamp(x * scale, -max, max))`` in the FP8 dtype."""
    fmax = FP8_MAX[fp8_dtype]
    return (x.float() * scale).clamp_(-fmax, fmax).to(fp8_dtype)  # in place: the product is a fresh tensor


def scales_for(block_amaxes: torch.Tensor, granularity: Granularity, fp8_dtype: torch.dtype, margin: int = 0):
    """(scale, scale_inv) for amaxes: FP8_MAX / amax, or the MX power of two."""
    if granularity is Granularity.MX_1x32:
        scale_inv = e8m0_to_scale_inv(amax_to_e8m0(block_amaxes, fp8_dtype))
        return torch.reciprocal(scale_inv), scale_inv
    scale = amax_to_scale(block_amaxes, fp8_dtype, margin)
    return scale, scale_to_inv(scale)


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: Granularity,
    scale: Optional[torch.Tensor] = None,
) -> Quantized:
    """Quantize a 2-D tensor. ``scale`` (whole-tensor only) gives a precomputed scale, as
    delayed scaling and cross-rank agreed scales do; otherwise scales come from this tensor."""
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if use_triton(x) and x.numel():
        from . import triton_kernels

        if granularity is Granularity.TENSOR:
            q, _, _, scale_inv = triton_kernels.cast_transpose(x, fp8_dtype, scale, amax(x) if scale is None else None)
            return Quantized(q, scale_inv, granularity)
        # Blocks take no precomputed scale (quantize_reference refuses one); the kernels ignore it.
        return Quantized(*triton_kernels.quantize_blocks(x, fp8_dtype, granularity), granularity)
    return quantize_reference(x, fp8_dtype, granularity, scale)


def quantize_reference(x, fp8_dtype, granularity, scale=None) -> Quantized:
    if granularity is Granularity.TENSOR:
        if scale is None:
            scale = amax_to_scale(amax(x), fp8_dtype)
        scale = scale.float().reshape(())
        return Quantized(saturate_cast(x, scale, fp8_dtype), scale_to_inv(scale), granularity)
    if scale is not None:
        raise ValueError("a precomputed scale applies to whole-tensor scaling only")
    return quantize_with_block_amax(x, block_amax(x, granularity), fp8_dtype, granularity)


def quantize_with_block_amax(x, block_amaxes, fp8_dtype, granularity, margin: int = 0) -> Quantized:
    """Quantize with given per-block amaxes (e.g. agreed across the ranks sharing a block)."""
    scale, scale_inv = scales_for(block_amaxes, granularity, fp8_dtype, margin)
    if granularity is Granularity.TENSOR:
        return Quantized(saturate_cast(x, scale, fp8_dtype), scale_inv, granularity)
    q = saturate_cast(_padded_blocks(x.float(), granularity.block), scale[:, None, :, None], fp8_dtype)
    mb, bm, kb, bk = q.shape
    data = q.reshape(mb * bm, kb * bk)[: x.shape[0], : x.shape[1]].contiguous()
    return Quantized(data, scale_inv, granularity)


def cast_transpose(x: torch.Tensor, fp8_dtype: torch.dtype, scale: Optional[torch.Tensor] = None):
    """Whole-tensor quantization of ``x`` and of ``x.t()`` (contiguous), plus ``x``'s amax and
    the ``scale_inv`` used: what a linear needs for both of its GEMMs. Without ``scale`` the
    scale comes from this amax (current scaling). On CUDA: one pass to find the amax, one
    to cast and transpose, the scale computed on the device in between."""
    if use_triton(x) and x.numel():
        from . import triton_kernels

        return triton_kernels.cast_transpose(x, fp8_dtype, scale, amax(x) if scale is None else None)
    x_amax = amax(x)
    if scale is None:
        scale = amax_to_scale(x_amax, fp8_dtype)
    q = saturate_cast(x, scale, fp8_dtype)
    return q, q.t().contiguous(), x_amax, scale_to_inv(scale).reshape(())


def quantize_1x128_both_ways(x: torch.Tensor, fp8_dtype: torch.dtype) -> Tuple[Quantized, Quantized]:
    """``x`` in 1x128 blocks along its rows and ``x.t()`` likewise (128x1 blocks of ``x``):
    the two forms an activation or gradient takes in a block-scaled linear. One pass on CUDA."""
    if use_triton(x, in_graph=True) and x.numel():
        from . import triton_kernels

        if torch.compiler.is_compiling():  # [Note: a Triton kernel inside compiled graphs]
            q, scale_inv, q_t, scale_inv_t = triton_kernels.quantize_1x128_both_ways_in_graph(x, fp8_dtype)
        else:
            q, scale_inv, q_t, scale_inv_t = triton_kernels.quantize_1x128_both_ways(x, fp8_dtype)
        return Quantized(q, scale_inv, Granularity.ROW_1x128), Quantized(q_t, scale_inv_t, Granularity.ROW_1x128)
    return (quantize_reference(x, fp8_dtype, Granularity.ROW_1x128),
            quantize_reference(x.t(), fp8_dtype, Granularity.ROW_1x128))


def quantize_transposed(x: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity,
                        scale: Optional[torch.Tensor] = None) -> Quantized:
    """``quantize(x.t().contiguous(), ...)``, the same bytes: a linear's input transposed for
    its weight gradient. 1x128 blocks of ``x.t()`` are found as 128x1 column blocks of ``x``
    where the torch code runs (CPU, and inside compiled graphs, where ``x`` is often
    recomputed from its producer's inputs): see ``_transposed_by_column_blocks``."""
    if (granularity is Granularity.ROW_1x128 and scale is None and x.dim() == 2 and x.shape[0] % 128 == 0
            and not use_triton(x)):
        return _transposed_by_column_blocks(x, fp8_dtype)
    return quantize(x.t().contiguous(), fp8_dtype, granularity, scale)


def _transposed_by_column_blocks(x: torch.Tensor, fp8_dtype: torch.dtype) -> Quantized:
    """``x.t()`` in 1x128 blocks, found as 128x1 column blocks of ``x``. Each block's amax is
    the larger of its two 64-row halves': Inductor keeps a reduction over up to 64 strided rows
    in registers (one pass over ``x``) and loops twice over one of 128. Written as the
    transpose's own blocks, Inductor's code made an fp32 copy of the scaled values in that
    looping kernel and cast it in a second, transposing one (0.217 + 0.084 ms for model A's
    SwiGLU output on an H200); written so, the amaxes take one reading kernel and the cast
    joins the SwiGLU backward's (docs/PERFORMANCE.md, 2026-11-26 second session)."""
    m, k = x.shape
    xf = x.detach().float()
    amax = xf.abs().reshape(m // 128, 2, 64, k).amax(dim=2).amax(dim=1)  # (m / 128, k)
    scale, scale_inv = scales_for(amax, Granularity.ROW_1x128, fp8_dtype)
    q = saturate_cast(xf.reshape(m // 128, 128, k), scale[:, None, :], fp8_dtype)
    return Quantized(q.view(m, k).t().contiguous(), scale_inv.t().contiguous(), Granularity.ROW_1x128)
