"""FP8 formats and scale math: dtypes, largest values, scales from amax, e8m0 exponents.

Conventions (as in TransformerEngine): ``scale`` multiplies a high-precision value into the
FP8 range, ``scale_inv = 1 / scale`` multiplies an FP8 value back, and every FP8 tensor is
stored with its ``scale_inv``. All scale math is fp32 and IEEE-rounded, so the Triton
kernels reproduce it bit for bit.
"""

from __future__ import annotations

import enum
import math

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Exponent of the largest power of two not above FP8_MAX (448 = 1.75 * 2**8).
FP8_EMAX = {E4M3: 8, E5M2: 15}
# cuBLAS refuses (CUBLAS_STATUS_NOT_SUPPORTED) a _scaled_mm scale pointer that is not 16-byte
# aligned: fp32 scales that share an allocation start SCALE_ALIGN elements apart.
SCALE_ALIGN = 4
E8M0_BIAS = 127


def aligned(values: torch.Tensor) -> torch.Tensor:
    """``values`` [G] stored SCALE_ALIGN elements apart: each ``out[g]`` is a 0-d scale that
    torch._scaled_mm takes."""
    out = torch.empty(values.numel(), SCALE_ALIGN, dtype=values.dtype, device=values.device)[:, 0]
    return out.copy_(values)


class Granularity(enum.Enum):
    """Which elements share one scale."""

    TENSOR = "tensor"  # one scale per tensor
    ROW_1x128 = "1x128"  # 128 consecutive elements of a row
    BLOCK_128x128 = "128x128"  # a 128 x 128 tile
    MX_1x32 = "1x32"  # 32 consecutive elements of a row, power-of-two (e8m0) scale

    @property
    def block(self):
        """(rows, cols) of one scaling block; None for whole-tensor scaling."""
        return {
            Granularity.TENSOR: None,
            Granularity.ROW_1x128: (1, 128),
            Granularity.BLOCK_128x128: (128, 128),
            Granularity.MX_1x32: (1, 32),
        }[self]


def mx_scale_count(shape) -> int:
    """The 1x32 (MX) scales of a tensor of ``shape``: one per 32 elements (or fewer, at the end)
    of each row of the last dim, whatever the leading dims (an experts weight's E x N rows)."""
    return math.prod(shape[:-1]) * math.ceil(shape[-1] / Granularity.MX_1x32.block[1])


def check_fp8_dtype(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2")


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """``FP8_MAX / amax / 2**margin`` in fp32; 1 where amax is 0 or not finite (nothing to scale).

    The quotient is taken in fp64 and rounded to fp32 once: for division, a format of at
    least 2p + 2 bits rounds twice to the same result as one IEEE fp32 division, so this is
    the exactly rounded fp32 scale everywhere, including in code torch.compile generates,
    whose fp32 division is approximate (Triton's div.full)."""
    amax = amax.float()
    scale = (FP8_MAX[fp8_dtype] / amax.double()).float()
    if margin:
        scale = scale * 2.0**-margin  # exact (a power of two), unlike a compiled division
    good = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(good, scale, torch.ones_like(scale))


def scale_to_inv(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, exactly rounded to fp32 (through fp64, as in amax_to_scale)."""
    return torch.reciprocal(scale.double()).float()


def amax_to_e8m0(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """OCP MX shared exponent as biased uint8: ``floor(log2(amax)) - emax + 127``.

    Read from the fp32 exponent bits, so it is exact; amax 0 gives 0 (2**-127) and NaN 255."""
    amax = amax.float()
    exponent = (amax.view(torch.int32) >> 23) & 0xFF  # biased exponent of amax
    biased = (exponent - FP8_EMAX[fp8_dtype]).clamp(0, 254)
    biased = torch.where(torch.isnan(amax), torch.full_like(biased, 255), biased)
    return biased.to(torch.uint8)


def e8m0_to_scale_inv(e8m0: torch.Tensor) -> torch.Tensor:
    """2 ** (e8m0 - 127) as fp32, built from exponent bits (exact, including 2**-127)."""
    biased = e8m0.to(torch.int32)
    normal = (biased << 23).view(torch.float32)
    subnormal = torch.full_like(normal, 2.0**-127)
    out = torch.where(biased == 0, subnormal, normal)
    return torch.where(biased == 255, torch.full_like(out, float("nan")), out)


def scale_inv_to_e8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """The biased exponent of a power-of-two fp32 ``scale_inv`` (the inverse of e8m0_to_scale_inv)."""
    return ((scale_inv.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
