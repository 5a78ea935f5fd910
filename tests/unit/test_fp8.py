"""FP8 formats, quantization, recipes and the FP8 linear (single process, CPU)."""

import math
import warnings

import pytest
import torch
import torch.nn as nn

from fsdp8.fp8.convert import convert_to_fp8
from fsdp8.fp8.formats import (
    E4M3, E5M2, FP8_MAX, Granularity, amax_to_e8m0, amax_to_scale, e8m0_to_scale_inv, scale_inv_to_e8m0, scale_to_inv,
)
from fsdp8.fp8.kernels import (
    Quantized, amax, amaxes, fp8_to_float, partial_block_amax, quantize, quantize_block_pieces, quantize_pieces,
    quantize_reference, quantize_rows_with_grid, quantize_transposed, saturate_cast,
)
from fsdp8.fp8.linear import Float8Linear
from fsdp8.fp8.recipes import (
    DelayedScaling, DelayedState, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, recipe_from_name,
    update_delayed_states,
)
from fsdp8.fp8.tensor import Float8Tensor

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


# -- the linear -------------------------------------------------------------------------------------
RECIPES = [Float8CurrentScaling(), DelayedScaling(amax_history_len=8), Float8BlockScaling(), MXFP8BlockScaling(),
           Float8CurrentScaling(fp8_format="e4m3")]


def _emulated_reference(x, w, b, dy, recipe, state=None):
    """Out, dx, dw from explicitly quantized operands and fp32 matmuls (the emulation's)."""
    xg, wg, gg = recipe.x_granularity, recipe.w_granularity, recipe.g_granularity
    f, bw = recipe.fwd_dtype, recipe.bwd_dtype

    def q(t, dtype, g, row):
        if state is not None:
            return quantize(t, dtype, g, scale=state.scale[row])
        return quantize(t, dtype, g)

    qx, qxt = q(x, f, xg, 0), q(x.t().contiguous(), f, xg, 0)
    qw = q(w, f, wg, 1)
    qwt = (quantize(qw.dequantize().t().contiguous(), f, wg) if wg is Granularity.MX_1x32 else qw.t().contiguous())
    qdy, qdyt = q(dy, bw, gg, 2), q(dy.t().contiguous(), bw, gg, 2)
    deq = lambda t: t.dequantize(torch.float32)  # noqa: E731
    out = (deq(qx) @ deq(qw).t()).to(x.dtype) + b
    dx = (deq(qdy) @ deq(qwt).t()).to(x.dtype)
    dw = (deq(qdyt) @ deq(qxt).t()).to(x.dtype)
    return out, dx, dw


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.fp8_format}")
def test_float8_linear_equals_emulated_reference_exactly(recipe):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).to(torch.bfloat16)
    convert_to_fp8(lin, recipe)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 128, dtype=torch.bfloat16)
    state = lin.delayed_state(x.device)
    if state is not None:  # give delayed scaling a non-trivial history first
        lin(x.detach()).backward(dy)
        lin.zero_grad(set_to_none=True)
        state.update()
        scales = state.scale.clone()
    out = lin(x)
    out.backward(dy)
    ref_state = None
    if state is not None:
        ref_state = DelayedState(recipe, x.device)
        ref_state.scale = scales
    ref_out, ref_dx, ref_dw = _emulated_reference(x.detach(), lin.weight.detach(), lin.bias.detach(), dy, recipe, ref_state)
    assert torch.equal(out, ref_out)
    assert torch.equal(x.grad, ref_dx)
    assert torch.equal(lin.weight.grad, ref_dw)
    assert torch.equal(lin.bias.grad, dy.float().sum(0).to(torch.bfloat16))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.fp8_format}")
def test_float8_linear_close_to_bf16_linear(recipe):
    """For operands with independent relative rounding errors uniform in [-u, u], a dot
    product's relative error has RMS sqrt((u_a**2 + u_b**2) / 3); allow 1.5x that."""
    torch.manual_seed(0)
    ref = nn.Linear(512, 256).to(torch.bfloat16)
    lin = nn.Linear(512, 256).to(torch.bfloat16)
    lin.load_state_dict(ref.state_dict())
    convert_to_fp8(lin, recipe)
    x = torch.randn(128, 512, dtype=torch.bfloat16)
    dy = torch.randn(128, 256, dtype=torch.bfloat16)
    outs = []
    for module in (ref, lin):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(dy)
        outs.append((y, xi.grad, module.weight.grad))
    u_f, u_b = UNIT_ROUNDOFF[recipe.fwd_dtype], UNIT_ROUNDOFF[recipe.bwd_dtype]
    bound_fwd = 1.5 * math.sqrt(2 * u_f**2 / 3)
    bound_bwd = 1.5 * math.sqrt((u_f**2 + u_b**2) / 3)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    assert rel(y1, y0) <= bound_fwd
    assert rel(dx1, dx0) <= bound_bwd
    assert rel(dw1, dw0) <= bound_bwd


def test_delayed_history_rolls_and_reduces():
    recipe = DelayedScaling(amax_history_len=3, margin=1)
    state = DelayedState(recipe, torch.device("cpu"))
    for amax in (1.0, 4.0, 2.0, 0.5):
        state.record(0, torch.tensor(amax))
        state.update()
    assert state.history[0].tolist() == [0.5, 2.0, 4.0]  # newest first; the 1.0 rolled out
    assert state.scale[0].item() == 448.0 / 4.0 / 2  # max of the history, margin 1
    most_recent = DelayedState(DelayedScaling(amax_history_len=3, amax_compute="most_recent"), torch.device("cpu"))
    most_recent.record(2, torch.tensor(8.0))
    most_recent.update()
    assert most_recent.scale[2].item() == 57344.0 / 8.0  # hybrid: gradients in e5m2
    a, b = DelayedState(recipe, torch.device("cpu")), DelayedState(recipe, torch.device("cpu"))
    a.record(1, torch.tensor(3.0))
    b.record(1, torch.tensor(5.0))
    update_delayed_states([a, b])
    assert a.history[1, 0].item() == 3.0 and b.history[1, 0].item() == 5.0 and not a.dirty


def test_recipe_validation():
    with pytest.raises(ValueError, match="fp8_format='e5m2'"):
        Float8CurrentScaling(fp8_format="e5m2")
    with pytest.raises(ValueError, match="use one of 'e4m3'"):
        Float8BlockScaling(fp8_format="hybrid")
    with pytest.raises(ValueError, match="amax_compute"):
        DelayedScaling(amax_compute="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)


def test_convert_to_fp8_filters_and_keeps_parameters():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.Linear(10, 32))
    weight = model[0].weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert convert_to_fp8(model, Float8CurrentScaling()) is model
    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == ["0"]
    assert len(caught) == 1 and "2 linear layer(s)" in str(caught[0].message) and "2 (64x10)" in str(caught[0].message)
    assert isinstance(model[0], Float8Linear) and model[0].weight is weight
    assert not isinstance(model[2], Float8Linear)
    untouched = convert_to_fp8(nn.Sequential(nn.Linear(32, 64)), Float8CurrentScaling(), filter=lambda n, m: False)
    assert not any(isinstance(m, Float8Linear) for m in untouched.modules())
    lone = nn.Linear(32, 64)
    assert convert_to_fp8(lone, Float8CurrentScaling()) is lone and isinstance(lone, Float8Linear)
    with pytest.raises(TypeError, match="recipe must be an fsdp8 FP8 recipe"):
        convert_to_fp8(model, "current")


def test_float8_tensor_behaves_like_its_dequantized_value():
    x = torch.randn(16, 32)
    q = quantize(x, E4M3, Granularity.TENSOR)
    t = Float8Tensor(q.data, q.scale_inv, Granularity.TENSOR, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (16, 32)
    assert isinstance(t.detach(), Float8Tensor)
    assert torch.equal(t + 1, q.dequantize(torch.bfloat16) + 1)
    assert torch.equal(t.transposed().data.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
    assert isinstance(Quantized(q.data, q.scale_inv, Granularity.TENSOR).nbytes, int)


def test_linears_on_one_input_share_its_quantization_and_save_fp8_only():
    """q/k/v-style linears fed the same tensor quantize it once; what each saves for
    backward is FP8 (the input's transpose) plus the weight, never a bf16 input copy."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 32, bias=False).to(torch.bfloat16) for _ in range(3)]
    for layer in layers:
        convert_to_fp8(layer, Float8CurrentScaling())
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    outs = [layer(x) for layer in layers]
    saved = [out.grad_fn.qx_t for out in outs]  # the autograd node is the Function's ctx
    assert saved[0] is saved[1] is saved[2]  # one quantization of x, shared
    assert saved[0].data.dtype == torch.float8_e4m3fn and saved[0].shape == (64, 16)
    ctx_tensors = [v for v in vars(outs[0].grad_fn).values() if isinstance(v, torch.Tensor)]
    assert not any(t.dtype == torch.bfloat16 and t.numel() == x.numel() for t in ctx_tensors)
    # Sharing changes nothing numerically: a fresh input with the same values gives the same out.
    assert torch.equal(layers[2](x.detach().clone()), outs[2])
    sum(o.float().sum() for o in outs).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _grads_after(model, forward, x):
    x = x.clone().requires_grad_(True)
    out = forward(x)
    out.square().mean().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads


def _two_linears(recipe=None):
    torch.manual_seed(0)
    model = _TwoLinears()
    if recipe is not None:
        convert_to_fp8(model, recipe)
    return model


@pytest.mark.parametrize("recipe_name", ["fp8-current", "fp8-block", "fp8-delayed", "fp8-mxfp8"])
def test_float8_linear_under_torch_compile(recipe_name):
    """Traced linears (current, block and MX scaling) compile into one graph (fullgraph) and
    match eager; standalone delayed scaling (which updates its state at each forward) stays an
    opaque call inside the compiled block and still matches. fp32 compute: the
    compiler quantizes the same values with the same formulas, so the bound is fp32 reordering (1e-6)."""
    recipe = recipe_from_name(recipe_name)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    eager_model, compiled_model = _two_linears(recipe), _two_linears(recipe)
    traced = all(m.traced() for m in compiled_model.modules() if isinstance(m, Float8Linear))
    assert traced == (recipe.traceable and not recipe.delayed)
    eager_out, eager_grads = _grads_after(eager_model, eager_model.forward, x)
    out, grads = _grads_after(compiled_model, torch.compile(compiled_model.forward, fullgraph=traced), x)
    assert (out - eager_out).norm() <= 1e-6 * eager_out.norm()
    for got, want in zip(grads, eager_grads):
        assert (got - want).norm() <= 1e-6 * want.norm()
    # And it is FP8: far from the unquantized layers' result.
    plain = _two_linears()
    plain_out, _ = _grads_after(plain, plain.forward, x)
    assert (out - plain_out).norm() > 1e-3 * plain_out.norm()


def test_delayed_scaling_traced_under_torch_compile():
    """Delayed scaling with its states updated between steps (as the engine does) compiles
    into one graph (fullgraph: a graph break fails) that reads the scale buffers and folds
    the amaxes of x and w (forward) and dy (backward) into the pending buffers in place.
    Over four steps (scales from the history from step 1 on) it gives eager's outputs, input
    gradients, pending amaxes, histories and scales bit for bit, and its weight and bias
    gradients within the bound of a reordered sum. fp64 compute, as in the engine's compiled
    tests: the FP8 bytes are equal, and the emulated GEMMs' fp64 products of dequantized FP8
    values are nearly exact. The weight and bias gradients are sums over the n = 64 rows,
    which the compiled code may order otherwise (it does on one AVX2 machine, not on the CI
    machine of earlier runs): each order of a sum of n products is within n u sum|a b| of
    the exact one (u = eps / 2; n - 1 additions and the products' rounding), so two are
    within n eps sum|a b| of each other; the dequantized operands are at most 1/8 (e5m2 dy)
    and 1/16 (e4m3 x) larger than dy and x, hence the factor 1.2 on sum|dy| |x|. The bias
    gradient's products are exact (dy times 1): (n - 1) eps sum|dy|."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recipe = DelayedScaling(amax_history_len=4)
    models = [_two_linears(recipe).double() for _ in range(2)]
    for model in models:
        for m in model.modules():
            if isinstance(m, Float8Linear):
                m.external_delayed_update = True
    eager, compiled = models
    forwards = (eager.forward, torch.compile(compiled.forward, fullgraph=True))
    inputs, dys = {}, {}  # eager's, per linear: what bounds its weight gradient
    for name in ("up", "down"):
        layer = getattr(eager, name)
        layer.register_forward_hook(lambda m, args, out, name=name: inputs.__setitem__(name, args[0].detach()))
        layer.register_full_backward_hook(lambda m, grad_in, grad_out, name=name: dys.__setitem__(name, grad_out[0]))

    def states(model):
        return [m.delayed_state(torch.device("cpu")) for m in model.modules() if isinstance(m, Float8Linear)]

    for step in range(4):
        x = torch.randn(2, 32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(step)) * (step + 1)
        runs = []
        for model, forward in zip(models, forwards):
            x_in = x.clone().requires_grad_(True)
            out = forward(x_in)
            out.square().mean().backward()
            runs.append((out.detach(), x_in.grad, {n: p.grad for n, p in model.named_parameters()},
                         torch.stack([s.pending for s in states(model)])))
            update_delayed_states(states(model))
            model.zero_grad(set_to_none=True)
        (want_out, want_dx, want_grads, want_pending), (out, dx, grads, pending) = runs
        assert torch.equal(out, want_out) and torch.equal(dx, want_dx) and torch.equal(pending, want_pending), step
        assert (pending > 0).all()  # every row recorded: x, w and dy
        eps = torch.finfo(torch.float64).eps
        for name, want in want_grads.items():
            layer, kind = name.split(".")
            dy = dys[layer].reshape(-1, dys[layer].shape[-1]).abs()
            if kind == "bias":
                bound = (dy.shape[0] - 1) * eps * dy.sum(0)
            else:
                bound = 1.2 * dy.shape[0] * eps * (dy.t() @ inputs[layer].reshape(dy.shape[0], -1).abs())
            assert ((grads[name] - want).abs() <= bound).all(), (step, name)
    for a, b in zip(states(eager), states(compiled)):
        assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale)
        assert a.scale.ne(1).all()  # scales came from the histories
    assert not torch._dynamo.utils.counters["graph_break"]


def test_delayed_state_changed_between_compiled_forward_and_backward_raises():
    """A compiled block's backward folds dy's amax into the pending amaxes its forward left
    (see the note in Float8Linear.forward); a state update in between would be overwritten,
    so autograd's version check must refuse it rather than let the amaxes go wrong."""
    recipe = DelayedScaling(amax_history_len=4)
    model = _two_linears(recipe).double()
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in linears:
        m.external_delayed_update = True
    forward = torch.compile(model.forward, fullgraph=True)
    x = torch.randn(2, 32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    loss = forward(x).square().mean()
    update_delayed_states([m._delayed for m in linears])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("compute,margin", [("max", 0), ("most_recent", 1)])
def test_batched_delayed_update_equals_each_state_updated_alone(compute, margin):
    """recipes.update_states (every linear's history in a few launches) against
    DelayedState.update one by one: histories, scales and pending bit for bit over steps with
    zeros, infinities and a NaN among the amaxes."""
    from fsdp8.fp8.recipes import DelayedScaling, DelayedState, update_states

    recipe = DelayedScaling(amax_history_len=4, amax_compute=compute, margin=margin)
    alone = [DelayedState(recipe, torch.device("cpu")) for _ in range(5)]
    batched = [DelayedState(recipe, torch.device("cpu")) for _ in range(5)]
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        amaxes = torch.rand(5, 3, generator=g) * 10 ** torch.randint(-3, 4, (5, 3), generator=g)
        amaxes[step % 5, step % 3] = (0.0, float("inf"), float("nan"))[step % 3]
        for state, row in zip(alone, amaxes):
            state.pending.fill_(1.0)
            state.update(row)
        for state in batched:
            state.pending.fill_(1.0)
        scales = update_states(batched, amaxes)
        for a, b, row_scale in zip(alone, batched, scales):
            for name in ("history", "scale", "pending", "scale_inv_column"):  # bit patterns: NaN included
                assert torch.equal(getattr(a, name).view(torch.int32), getattr(b, name).view(torch.int32)), (step, name)
            assert torch.equal(row_scale, b.scale) and (a.steps, a.dirty) == (b.steps, b.dirty)
            # The kept inverses: the scales' (scale_to_inv), each where cuBLAS takes a scale.
            assert torch.equal(torch.stack(b.scale_inv), scale_to_inv(b.scale))
            assert all(inv.data_ptr() % 16 == 0 for inv in b.scale_inv)


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


def test_batched_delayed_update_with_several_recipes():
    """States of different recipes (history lengths, amax rules, margins) in one batch are
    updated in their own groups and their scales come back in the states' order."""
    from fsdp8.fp8.recipes import DelayedScaling, DelayedState, update_states

    recipes = [DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=8, amax_compute="most_recent", margin=1)]
    order = [0, 1, 0, 1, 0]
    alone = [DelayedState(recipes[i], torch.device("cpu")) for i in order]
    batched = [DelayedState(recipes[i], torch.device("cpu")) for i in order]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        amaxes = torch.rand(5, 3, generator=g) * 100
        for state, row in zip(alone, amaxes):
            state.update(row)
        scales = update_states(batched, amaxes)
        for a, b, row_scale in zip(alone, batched, scales):
            assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale) and torch.equal(row_scale, b.scale)


def test_outer_major_scale_grids_reach_the_gemm_without_a_copy():
    """fp8_mm hands cuBLAS 1x128 scales outer-dimension-major; a grid made so (as the Triton
    quantizations write theirs) passes through as it is, a row-major one is copied."""
    from fsdp8.fp8.linear import _outer_major
    from fsdp8.fp8.triton_kernels import scale_blocks_outer_major

    grid = scale_blocks_outer_major(256, 3, torch.device("cpu"))
    assert grid.shape == (256, 3) and grid.stride() == (1, 256)
    assert _outer_major(grid).data_ptr() == grid.data_ptr()
    assert grid.t().contiguous().data_ptr() == grid.data_ptr()  # the weight-gradient GEMM's second operand
    row_major = torch.ones(256, 3)
    assert _outer_major(row_major).data_ptr() != row_major.data_ptr()
