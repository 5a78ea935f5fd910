"""Float8Tensor: FP8 bytes and their scales, posing as a tensor of the compute dtype.

The sharding engine gives a Float8Linear its gathered weight as a Float8Tensor, so the
GEMMs use the 8-bit bytes that travelled over the wire as they are; FP8 experts get their 3-D
weight [E, N, K] so, each expert's matrix with its own scales (fsdp8.engine.fp8_experts). Any
other op sees the dequantized value, so code that does not know about FP8 still works (slowly).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.utils._pytree import tree_map

from .formats import Granularity, aligned
from .kernels import Quantized, quantize
from .triton_grouped import transpose_bytes

_ALIAS_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_SAME_SHAPE_VIEWS = {torch.ops.aten.as_strided.default, torch.ops.aten.view.default}


def _leading_rows(args) -> bool:
    """as_strided(t, size, stride, offset) that keeps whole leading rows of a contiguous
    whole-tensor-scaled ``t``."""
    src, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else 0
    return (src._granularity is Granularity.TENSOR and src.dim() == 2 and (offset or 0) == 0
            and src._data.is_contiguous()
            and size[1:] == tuple(src.shape[1:]) and size[0] <= src.shape[0] and stride == src._data.stride())


def transpose_of(q: Quantized) -> Quantized:
    """``q``'s transpose quantized along its rows: a transposed copy of the bytes where the
    blocks read the same either way (whole tensor, 128x128); MX blocks are quantized again."""
    if q.granularity is Granularity.MX_1x32:
        return quantize(q.dequantize(torch.float32).t().contiguous(), q.fp8_dtype, Granularity.MX_1x32)
    return q.t().contiguous()


class Float8Tensor(torch.Tensor):
    """A 2-D FP8 tensor with ``scale_inv`` (per tensor or per block) and a logical dtype; or a
    3-D one, E matrices whose ``scale_inv`` is one per matrix ([E]) or a grid per matrix
    ([E, ceil(N / 128), ceil(K / 128)]: each matrix's rows padded to whole blocks).

    What the GEMMs derive from the bytes (transposes; a 3-D tensor's matrices with their
    scales 16 bytes apart) is made once and kept until ``clear_transpose`` (the engine calls it
    at each gather). An alias starts without it: whoever refills the bytes clears the tensor
    it holds, not the aliases made from it."""

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _granularity: Granularity

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, granularity: Granularity,
                dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=requires_grad
        )

    def __init__(self, data, scale_inv, granularity, dtype, requires_grad: bool = False):
        self._data = data
        self._scale_inv = scale_inv
        self._granularity = granularity
        self._derived: dict = {}

    def __repr__(self) -> str:
        return (f"Float8Tensor(shape={tuple(self.shape)}, fp8={self._data.dtype}, "
                f"granularity={self._granularity.value}, dtype={self.dtype})")

    # torch.compile traces through a Float8Tensor (a compiled block's Float8Linear reads the
    # bytes and scales of its engine-gathered weight) by taking it apart into these tensors.
    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], (self._granularity, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        granularity, dtype = meta
        return Float8Tensor(inner["_data"], inner["_scale_inv"], granularity, dtype)

    def quantized(self) -> Quantized:
        return Quantized(self._data, self._scale_inv, self._granularity)

    def transposed(self) -> Quantized:
        """The transposed FP8 copy the input-gradient GEMM needs, made once per gather."""
        if "t" not in self._derived:
            self._derived["t"] = transpose_of(self.quantized())
        return self._derived["t"]

    def matrices(self) -> List[Quantized]:
        """A 3-D tensor's matrices, each with its scales (per tensor: a 0-d scale_inv on a
        16-byte boundary, as torch._scaled_mm takes it)."""
        if "matrices" not in self._derived:
            inv = aligned(self._scale_inv) if self._granularity is Granularity.TENSOR else self._scale_inv
            self._derived["matrices"] = [Quantized(self._data[g], inv[g], self._granularity)
                                         for g in range(self._data.shape[0])]
        return self._derived["matrices"]

    def transposed_matrices(self) -> List[Quantized]:
        """Each matrix's transpose, for the input-gradient GEMMs, made once per gather (per tensor:
        views of ``transposed_bytes``, one copy for all; blocks: each matrix's own)."""
        if "matrices_t" not in self._derived:
            if self._granularity is Granularity.TENSOR:
                self._derived["matrices_t"] = [Quantized(t, q.scale_inv, q.granularity)
                                               for t, q in zip(self.transposed_bytes(), self.matrices())]
            else:
                self._derived["matrices_t"] = [transpose_of(q) for q in self.matrices()]
        return self._derived["matrices_t"]

    def transposed_bytes(self) -> torch.Tensor:
        """A 3-D per-tensor weight's matrices transposed, [E, K, N] contiguous: the input-gradient
        operand of the grouped FP8 kernel (fsdp8/fp8/grouped_kernel.py), made once per gather."""
        if "bytes_t" not in self._derived:
            self._derived["bytes_t"] = transpose_bytes(self._data)
        return self._derived["bytes_t"]

    def clear_transpose(self) -> None:
        """Forget what was derived from the bytes (they are about to change)."""
        self._derived.clear()

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if self._data.dim() == 3:
            return torch.stack([q.dequantize(dtype or self.dtype) for q in self.matrices()])
        return self.quantized().dequantize(dtype or self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIAS_OPS or (func in _SAME_SHAPE_VIEWS and tuple(args[1]) == tuple(args[0].shape)):
            # Aliases and identity views (FSDP2 re-strides the tensor it gathered) keep the bytes.
            src = args[0]
            return Float8Tensor(src._data, src._scale_inv, src._granularity, src.dtype)
        if func is torch.ops.aten.as_strided.default and _leading_rows(args):
            # FSDP2 cuts the padding rows off a gathered, padded parameter: still the same bytes.
            src, size = args[0], tuple(args[1])
            return Float8Tensor(src._data[: size[0]], src._scale_inv, src._granularity, src.dtype)
        # Everything else runs on the dequantized value (a meta tensor carries no values).
        def unwrap(t):
            if not isinstance(t, Float8Tensor):
                return t
            return torch.empty(t.shape, dtype=t.dtype, device="meta") if t.is_meta else t.dequantize()

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
