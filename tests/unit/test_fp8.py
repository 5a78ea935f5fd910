"""FP8 formats and quantization (single process, CPU); the linear is test_fp8_linear.py's, the
engine's weight kernels test_fp8_weight_kernels.py's."""

import math

import pytest
import torch

from fsdp8.fp8.formats import (
    E4M3, E5M2, FP8_MAX, Granularity, amax_to_e8m0, amax_to_scale, e8m0_to_scale_inv, scale_inv_to_e8m0,
)
from fsdp8.fp8.kernels import amax, fp8_to_float, quantize, quantize_reference, quantize_transposed, saturate_cast

GRANULARITIES = list(Granularity)
# Half an ulp, relative, of a normal FP8 value: 2**-(mantissa bits + 1).
UNIT_ROUNDOFF = {E4M3: 2.0**-4, E5M2: 2.0**-3}
# Half the subnormal spacing, the absolute error floor in the scaled domain.
SUBNORMAL_HALF = {E4M3: 2.0**-10, E5M2: 2.0**-17}


def _slow_block_quantize(x, fp8, granularity):
    """Block quantization written out block by block (independent of fsdp8's kernels)."""
    bm, bk = granularity.block
    rows, cols = x.shape
    data = torch.empty_like(x, dtype=fp8)
    inv = torch.empty(math.ceil(rows / bm), math.ceil(cols / bk))
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            block = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk].float()
            a = block.abs().max()
            if granularity is Granularity.MX_1x32:
                exponent = max(math.floor(math.log2(a)) - (8 if fp8 == E4M3 else 15), -127) if a > 0 else -127
                scale_inv = 2.0 ** exponent
                scale = 1.0 / scale_inv
            else:
                # tensor / tensor is an IEEE division (float / tensor would multiply by a reciprocal)
                scale = torch.tensor(FP8_MAX[fp8]) / a.float() if a > 0 else torch.tensor(1.0)
                scale_inv = torch.reciprocal(scale)
            inv[i, j] = scale_inv
            data[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = (block * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    return data, inv


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 200), (130, 64)])
def test_quantize_transposed_is_the_transpose_quantized(fp8, dtype, shape):
    """A linear's input transposed for its weight gradient, 1x128 blocks of x.t(): whole
    128-row blocks of x go through 128x1 column blocks (amaxes as maxima of 64-row halves),
    other heights through the transpose itself. Byte for byte the block-by-block reference
    on finite values, and quantizing the materialized transpose with NaN, infinite and zero
    blocks (which the block-by-block reference does not treat as fsdp8 does)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])).to(dtype)
    x[:128, 5] = 0.0
    q = quantize_transposed(x, fp8, Granularity.ROW_1x128)
    data, inv = _slow_block_quantize(x.t(), fp8, Granularity.ROW_1x128)
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(q.scale_inv, inv.float())
    x[3, 1], x[100, 2] = float("nan"), -float("inf")
    q = quantize_transposed(x, fp8, Granularity.ROW_1x128)
    ref = quantize_reference(x.t().contiguous(), fp8, Granularity.ROW_1x128)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.allclose(q.scale_inv, ref.scale_inv, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("granularity", [Granularity.ROW_1x128, Granularity.BLOCK_128x128, Granularity.MX_1x32])
@pytest.mark.parametrize("shape", [(130, 260), (7, 33), (256, 128)])
def test_block_quantization_matches_block_by_block(granularity, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[1])  # columns of very different size
    q = quantize_reference(x, E4M3, granularity)
    data, inv = _slow_block_quantize(x, E4M3, granularity)
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(q.scale_inv, inv.float())


@pytest.mark.parametrize("fp8,granularity", [(f, g) for f in (E4M3, E5M2) for g in GRANULARITIES
                                             if not (g is Granularity.MX_1x32 and f == E5M2)])  # MX is e4m3 only
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e4, 1e30])
def test_round_trip_within_format_bound(fp8, granularity, magnitude):
    torch.manual_seed(1)
    x = torch.randn(64, 256) * magnitude
    q = quantize(x, fp8, granularity)
    back = q.dequantize(torch.float32)
    from fsdp8.fp8.kernels import expand_scale

    scale = 1.0 / expand_scale(q.scale_inv, granularity, x.shape)
    bound = torch.maximum(UNIT_ROUNDOFF[fp8] * x.abs(), SUBNORMAL_HALF[fp8] / scale)
    if granularity is Granularity.MX_1x32:
        # Power-of-two scales map a block's amax into [256, 512): values above 448 saturate.
        bound = torch.maximum(bound, (x.abs() - FP8_MAX[fp8] / scale).clamp_min(0))
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_fp8_to_float_is_the_conversion_bit_for_bit(fp8):
    """The CPU table lookup gives ``.float()``'s bits for every code (NaNs, infinities,
    subnormals, signed zeros), and keeps ``.float()``'s strides for a transposed tensor."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(64).view(fp8)  # 16,384: above the table's threshold
    for data in (codes, codes.view(128, 128)[:, :64].contiguous(), codes[:1024]):  # 1,024: the smallest looked up
        assert torch.equal(fp8_to_float(data).view(torch.int32), data.float().view(torch.int32))
    transposed = codes.view(128, 128).t()
    assert fp8_to_float(transposed).stride() == transposed.float().stride()
    assert torch.equal(fp8_to_float(transposed).view(torch.int32), transposed.float().view(torch.int32))


def test_saturation_zeros_and_nan():
    assert saturate_cast(torch.tensor([1e9, -1e9, 500.0]), torch.tensor(1.0), E4M3).float().tolist() == [448, -448, 448]
    assert saturate_cast(torch.tensor([1e9]), torch.tensor(1.0), E5M2).float().item() == 57344
    zeros = quantize(torch.zeros(4, 8), E4M3, Granularity.TENSOR)
    assert zeros.scale_inv.item() == 1.0 and torch.all(zeros.dequantize() == 0)
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    for granularity in GRANULARITIES:
        back = quantize(x, E4M3, granularity).dequantize()
        assert torch.isnan(back[1, 3])
    inf = quantize(torch.tensor([[float("inf"), 1.0]]), E4M3, Granularity.TENSOR)
    assert inf.scale_inv.item() == 1.0 and inf.dequantize()[0, 0].item() == 448.0


def test_amax_to_scale():
    amax = torch.tensor([448.0, 1.0, 0.0, float("inf"), float("nan")])
    assert amax_to_scale(amax, E4M3).tolist()[:3] == [1.0, 448.0, 1.0]
    assert amax_to_scale(amax, E4M3).tolist()[3] == 1.0 and amax_to_scale(amax, E4M3).tolist()[4] == 1.0
    assert amax_to_scale(torch.tensor(1.0), E4M3, margin=2).item() == 112.0


def test_e8m0_scales_are_exact_powers_of_two():
    amax = torch.tensor([448.0, 1.0, 3.0, 1e-30, 0.0, 1e38, float("nan")])
    e8m0 = amax_to_e8m0(amax, E4M3)
    # floor(log2(amax)) - 8 + 127: 448 -> 8, 1 -> 0, 3 -> 1, 1e-30 -> -100, 1e38 -> 126; 0 -> 0; NaN -> 255
    assert e8m0.tolist() == [127, 119, 120, 19, 0, 245, 255]
    inv = e8m0_to_scale_inv(e8m0)
    finite = inv[:-1]
    assert torch.equal(torch.log2(finite), torch.log2(finite).round())
    assert inv[4].item() == 2.0**-127 and torch.isnan(inv[-1])
    assert torch.equal(scale_inv_to_e8m0(inv[:-1]), e8m0[:-1])
    q = quantize(torch.randn(8, 64), E4M3, Granularity.MX_1x32)
    assert torch.equal(torch.log2(q.scale_inv), torch.log2(q.scale_inv).round())


def test_transpose_of_whole_tensor_and_128_blocks_is_exact():
    x = torch.randn(256, 384)
    for granularity in (Granularity.TENSOR, Granularity.BLOCK_128x128):
        q = quantize(x, E4M3, granularity)
        qt = quantize(x.t().contiguous(), E4M3, granularity)
        assert torch.equal(q.t().contiguous().data.view(torch.uint8), qt.data.view(torch.uint8))
        assert torch.equal(q.t().scale_inv, qt.scale_inv)
    with pytest.raises(ValueError, match="quantize the transpose instead"):
        quantize(x, E4M3, Granularity.ROW_1x128).t()
