"""The engine's weight-shard kernels (fsdp8/fp8/weight_kernels.py) on the CPU: shards quantized
with agreed scales into a send buffer, the one-call packs of many weights, and the amaxes
(whole-tensor and partial 128x128 grids) those scales come from."""

import math

import pytest
import torch

from fsdp8.fp8.formats import E4M3, E5M2, Granularity
from fsdp8.fp8.kernels import amax, saturate_cast
from fsdp8.fp8.weight_kernels import (
    amaxes, partial_block_amax, quantize_block_pieces, quantize_pieces, quantize_rows_with_grid,
)


def _near_bf16_ties(n: int, seed: int) -> torch.Tensor:
    """fp32 values on and next to bf16 rounding midpoints, over a wide range of magnitudes."""
    g = torch.Generator().manual_seed(seed)
    bf16 = (torch.randn(n, generator=g) * torch.logspace(-3, 3, n)).to(torch.bfloat16).float()
    midpoint = bf16 + bf16.abs() * 2.0**-9  # half a bf16 step above (to within fp32)
    nudge = torch.randint(-2, 3, (n,), generator=g).float() * bf16.abs() * 2.0**-23
    return torch.cat([bf16, midpoint, midpoint + nudge])


def test_amax_of_rounded_rows_is_rounded_amax():
    # The engine takes FP8 weight amaxes on the fp32 main rows and rounds the result to the
    # compute dtype instead of rounding every element first (fp8_unit.local_amaxes).
    for seed in range(20):
        x = _near_bf16_ties(3000, seed).view(-1, 30)
        assert amax(x.to(torch.bfloat16)).item() == amax(x).to(torch.bfloat16).float().item()
        grid = partial_block_amax(x, 7, 300)
        assert torch.equal(partial_block_amax(x.to(torch.bfloat16), 7, 300), grid.to(torch.bfloat16).float())


def test_amaxes_one_per_tensor():
    x = [torch.randn(5, 7), torch.zeros(0, 4), torch.randn(300) * 1e3, torch.tensor([1.0, float("nan"), -9.0])]
    got = amaxes(x)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert got[:3].tolist() == [amax(t).item() for t in x[:3]] and got[1].item() == 0.0 and torch.isnan(got[3])
    assert amaxes([]).shape == (0,)


@pytest.mark.parametrize("granularity", [Granularity.TENSOR, Granularity.BLOCK_128x128])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_rows_quantized_through_compute_dtype_into_a_buffer(granularity, fp8):
    rows = _near_bf16_ties(200, 1).view(15, 40) * 0.01  # inside the FP8 range after scaling
    if granularity is Granularity.TENSOR:
        scale = torch.tensor(2.0)
    else:
        scale = torch.rand(3, 1) * 100
        scale[1] = 2.0  # the block of global row 130, where row 0 of this slice sits
    # Just above an FP8 midpoint (between 1 and the next FP8 value) after the exact x2 scaling:
    # rounding to bf16 first lands on the midpoint itself, which rounds to even (down).
    rows[0, 0] = ((1.0625 if fp8 == E4M3 else 1.125) + 2.0**-20) / 2
    buffer = torch.full((rows.numel() + 16,), 0xAB, dtype=torch.uint8)
    region = buffer[8 : 8 + rows.numel()].view(fp8).view(rows.shape)
    out = quantize_rows_with_grid(rows, 130, scale, granularity, fp8, via=torch.bfloat16, out=region)
    assert out.data_ptr() == region.data_ptr()
    expected = quantize_rows_with_grid(rows.to(torch.bfloat16), 130, scale, granularity, fp8)
    assert torch.equal(region.view(torch.uint8), expected.view(torch.uint8))
    assert (buffer[:8] == 0xAB).all() and (buffer[-8:] == 0xAB).all()  # nothing outside the region
    # Rounding first matters: quantizing the fp32 values directly flips that byte.
    direct = quantize_rows_with_grid(rows, 130, scale, granularity, fp8)
    assert not torch.equal(direct.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_quantize_pieces_writes_each_piece_with_its_scale(fp8):
    """Pieces of one flat source land in one flat FP8 buffer, each as quantize_rows_with_grid
    quantizes it alone with its own scale; bytes between pieces stay untouched."""
    src = _near_bf16_ties(300, 2) * 0.01
    src[17] = float("nan")
    scales = torch.tensor([2.0, 0.5, 1e4, 7.0])
    pieces = [(0, 4, 100, 0), (100, 120, 37, 2), (137, 200, 163, 3), (5, 380, 0, 1)]
    out = torch.full((400,), 0xAB, dtype=torch.uint8)
    quantize_pieces(src, out.view(fp8), scales, pieces, fp8, via=torch.bfloat16)
    written = torch.zeros(400, dtype=torch.bool)
    for s_off, o_off, n, k in pieces:
        expected = quantize_rows_with_grid(src[s_off : s_off + n].view(1, n), 0, scales[k], Granularity.TENSOR, fp8,
                                           via=torch.bfloat16)
        assert torch.equal(out[o_off : o_off + n], expected.view(torch.uint8).flatten())
        written[o_off : o_off + n] = True
    assert (out[~written] == 0xAB).all()
    assert torch.isnan(out[4 + 17 : 4 + 18].view(fp8).float()).all()


def test_quantize_pieces_rejects_pieces_outside_the_buffers():
    src, out, scales = torch.zeros(10), torch.zeros(10, dtype=E4M3), torch.ones(2)
    with pytest.raises(ValueError, match="reaches outside"):
        quantize_pieces(src, out, scales, [(5, 0, 6, 0)], E4M3)
    with pytest.raises(ValueError, match="reaches outside"):
        quantize_pieces(src, out, scales, [(0, 0, 4, 2)], E4M3)
    with pytest.raises(ValueError, match="must be"):
        quantize_pieces(src, out.view(torch.uint8), scales, [(0, 0, 4, 0)], E4M3)


def test_rows_with_grid_rejects_a_grid_of_the_wrong_shape():
    rows = torch.zeros(10, 300)  # 3 grid columns; rows 250..259 reach grid row 2
    quantize_rows_with_grid(rows, 250, torch.ones(3, 3), Granularity.BLOCK_128x128, E4M3)
    for grid in (torch.ones(3, 2), torch.ones(2, 3), torch.ones(9)):
        with pytest.raises(ValueError, match="scale grid"):
            quantize_rows_with_grid(rows, 250, grid, Granularity.BLOCK_128x128, E4M3)
    with pytest.raises(ValueError, match="out must be"):
        quantize_rows_with_grid(rows, 250, torch.ones(3, 3), Granularity.BLOCK_128x128, E4M3,
                                out=torch.empty(10, 300, dtype=E5M2))


def _block_pieces_reference(src, scales, pieces, fp8, out_numel):
    """What quantize_block_pieces must write, from the block-scale definition: each element
    times its 128x128 block's scale (row block (row_start + r) // 128), via bf16."""
    out = torch.full((out_numel,), 0xAB, dtype=torch.uint8)
    for s_off, o_off, rows, cols, row_start, g_off in pieces:
        x = src[s_off : s_off + rows * cols].view(rows, cols).to(torch.bfloat16)
        grid_cols = math.ceil(cols / 128)
        r = (torch.arange(rows)[:, None] + row_start) // 128
        c = torch.arange(cols)[None, :] // 128
        scale = scales[g_off + r * grid_cols + c]
        out[o_off : o_off + rows * cols] = saturate_cast(x, scale, fp8).view(torch.uint8).flatten()
    return out


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_quantize_block_pieces_writes_each_piece_with_its_block_scales(fp8):
    """Many 128x128-scaled row ranges (shards starting inside a block, ragged columns, an
    empty piece) into one flat buffer, each element with its own block's scale; bytes
    between pieces stay untouched."""
    src = _near_bf16_ties(20600, 2) * 0.01  # 61,800 values
    src[17] = float("nan")
    scales = torch.rand(64) * 100 + 0.5
    pieces = [(0, 8, 300, 150, 70, 0),  # rows 70..369 of a 150-wide weight: grid rows 0-2, 2 columns
              (300 * 150, 300 * 150 + 40, 64, 260, 128, 8),  # rows 128..191 of a 260-wide one (3 grid columns)
              (5, 300 * 150 + 64 * 260 + 48, 0, 16, 0, 63)]
    n_out = 300 * 150 + 64 * 260 + 64
    out = torch.full((n_out,), 0xAB, dtype=torch.uint8)
    quantize_block_pieces(src, out.view(fp8), scales, pieces, fp8, via=torch.bfloat16)
    assert torch.equal(out, _block_pieces_reference(src, scales, pieces, fp8, n_out))
    assert torch.isnan(out[8 + 17 : 8 + 18].view(fp8).float()).all()


def test_quantize_block_pieces_rejects_pieces_outside_the_buffers():
    src, out, scales = torch.zeros(20000), torch.zeros(20000, dtype=E4M3), torch.ones(4)
    quantize_block_pieces(src, out, scales, [(0, 0, 28, 300, 100, 0)], E4M3)  # grid row 0 only: 3 scales
    with pytest.raises(ValueError, match="reaches outside"):
        quantize_block_pieces(src, out, scales, [(0, 0, 70, 300, 0, 0)], E4M3)  # 21,000 elements
    with pytest.raises(ValueError, match="reaches outside"):  # rows 100..139 touch grid row 1: 2 x 3 scales
        quantize_block_pieces(src, out, scales, [(0, 0, 40, 300, 100, 0)], E4M3)
    with pytest.raises(ValueError, match="must be"):
        quantize_block_pieces(src, out.view(torch.uint8), scales, [(0, 0, 1, 4, 0, 0)], E4M3)


@pytest.mark.parametrize("total,cols,start,n", [(512, 256, 0, 512), (700, 300, 130, 400), (700, 300, 0, 1),
                                                (300, 128, 257, 43), (256, 1000, 128, 128), (1000, 64, 5, 900)])
def test_partial_block_amax_is_each_blocks_largest_magnitude(total, cols, start, n):
    """Rows [start, start + n) of a (total, cols) weight: the 128x128 grid of the whole
    weight, each touched block's max |x| over these rows (NaN kept), untouched blocks 0,
    against the definition written block by block."""
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)) * 3
    if n > 3:
        x[2, 5] = float("nan")
    got = partial_block_amax(x, start, total)
    want = torch.zeros(-(-total // 128), -(-cols // 128))
    for r in range(want.shape[0]):
        for c in range(want.shape[1]):
            lo, hi = max(r * 128, start), min((r + 1) * 128, start + n)
            if lo < hi:
                want[r, c] = x[lo - start: hi - start, c * 128: (c + 1) * 128].abs().amax()
    assert got.shape == want.shape and torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))
