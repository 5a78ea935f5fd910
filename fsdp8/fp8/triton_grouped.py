"""The Triton kernel of the grouped FP8 experts (fsdp8/fp8/grouped_kernel.py): rows cast to FP8 with
their group's scale, written row-major and, where asked, transposed into the weight gradient's
16-aligned token buffer, in one pass over the rows. Bit for bit the torch reference
(``saturate_cast`` with each row's scale, then grouped_kernel's ``_scatter_columns``); tests/gpu checks it.

Measured on an H200 (torch 2.11, 32768 x 2048 bf16 rows, 32 groups): the same torch ops compiled
by Inductor took 0.37 ms for the cast and 0.86 ms for the padded transpose (a strided copy at
~160 GB/s). This kernel, tiles of 64 x 64 read once and written both ways as cast_transpose does
for dense layers (triton_kernels.py), averaged 0.62 ms per call over an expert projection's three
(input, weight, gradient): better than the two passes, still about 9x what its bytes need
(benchmarks/debug/grouped_fp8_gemms.py --profile); it is the next thing to make faster.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .formats import FP8_MAX
from .triton_kernels import _tl_dtype, available, saturating_cast, triton

if triton is not None:
    import triton.language as tl

    from .triton_kernels import _clamp_cast

    @triton.jit
    def _group_cast_kernel(x_ptr, scale_ptr, group_ptr, col_ptr, q_ptr, qt_ptr, M, K, W,
                           FMAX: tl.constexpr, OUT: tl.constexpr, TRANSPOSED: tl.constexpr,
                           SATURATE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        """Tile (BM rows, BK columns) of x [M, K] (bf16, contiguous): each row times its group's
        scale, cast; stored to q [M, K] and, TRANSPOSED, to qt [K, W] at each row's column."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rk = tl.program_id(1) * BK + tl.arange(0, BK)
        in_m = rm < M
        mask = in_m[:, None] & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        group = tl.load(group_ptr + rm, mask=in_m, other=0)
        scale = tl.load(scale_ptr + group, mask=in_m, other=1.0)
        q = _clamp_cast(x * scale[:, None], FMAX, OUT, SATURATE)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
        if TRANSPOSED:
            # 8-bit values transposed after a cast from bf16 (not fp32: see _cast_transpose_kernel).
            col = tl.load(col_ptr + rm, mask=in_m, other=0)
            tl.store(qt_ptr + rk[:, None] * W + col[None, :], tl.trans(q), mask=(rk[:, None] < K) & in_m[None, :])


INDEX_LIMIT = 2 ** 31  # the kernel's offsets are 32-bit


def runs_on(x: torch.Tensor, width: int = 0) -> bool:
    """Whether the kernel takes ``x`` [M, K] (and a transposed buffer [K, ``width``]): bf16 rows on a
    GPU with Triton, every offset within 32 bits."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.numel() < INDEX_LIMIT
            and x.shape[-1] * width < INDEX_LIMIT and available())


def group_cast(x: torch.Tensor, scale: torch.Tensor, group: torch.Tensor, fp8_dtype: torch.dtype,
               column: Optional[torch.Tensor] = None, width: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(rows of ``x`` [M, K] cast with ``scale[group]``, and with ``column`` the same bytes
    transposed into a zero buffer [K, ``width``] at each row's column, else None)."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    qt = None if column is None else torch.zeros((k, width), dtype=torch.uint8, device=x.device).view(fp8_dtype)
    bm = bk = 64
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _group_cast_kernel[grid](x, scale.float().contiguous(), group.contiguous(),
                             group if column is None else column.contiguous(), q, q if qt is None else qt,
                             m, k, width, FMAX=FP8_MAX[fp8_dtype], OUT=_tl_dtype(fp8_dtype),
                             TRANSPOSED=column is not None, SATURATE=saturating_cast(x.device), BM=bm, BK=bk)
    return q, qt
