"""FP8 on the GPU: Triton kernels bit for bit against the torch reference, native GEMMs."""

import math

import pytest
import torch

from fsdp8.fp8 import triton_kernels
from fsdp8.fp8.formats import E4M3, E5M2, Granularity, amax_to_scale
from fsdp8.fp8.kernels import amax, cast_transpose, quantize, quantize_reference, saturate_cast
from fsdp8.fp8.weight_kernels import (
    amaxes, block_amax_grids, partial_block_amax, quantize_block_pieces, quantize_pieces, quantize_rows_with_grid,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and triton_kernels.available()), reason="needs CUDA and Triton"),
]


def _inputs(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda") * torch.logspace(-4, 4, shape[1], device="cuda")
    x[0, 0] = 0.0
    if shape[0] > 3:
        x[3, :40] = 0.0  # an all-zero block
        x[2, 5] = float("nan")
    return x.to(dtype)


def _same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("granularity,fp8", [(g, f) for g in Granularity for f in (E4M3, E5M2)
                                             if not (g is Granularity.MX_1x32 and f == E5M2)])  # MX: e4m3 only
@pytest.mark.parametrize("shape", [(4096, 1024), (257, 300), (128, 128), (33, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_quantize_matches_reference_bit_for_bit(granularity, fp8, shape, dtype):
    x = _inputs(shape, dtype, seed=hash((granularity.value, shape)) % 1000)
    got = quantize(x, fp8, granularity)  # Triton on CUDA
    ref = quantize_reference(x, fp8, granularity)
    assert _same(got.data, ref.data)
    assert torch.equal(got.scale_inv, ref.scale_inv) or torch.allclose(got.scale_inv, ref.scale_inv, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_block_amax_grids_match_each_partial_grid(dtype):
    """One launch for many weights' 128x128 grids: each piece's grid equals partial_block_amax
    (rows starting inside a block, pieces with no rows, a NaN, uneven columns)."""
    pieces = []
    for i, (rows, start, total, cols) in enumerate([(256, 0, 256, 512), (70, 7, 300, 300), (0, 128, 256, 256),
                                                    (129, 128, 257, 1024), (5, 250, 255, 33)]):
        x = _inputs((max(rows, 1), cols), torch.float32, seed=i)[:rows].to(dtype).contiguous()
        pieces.append((x, start, total))
    got = block_amax_grids(pieces)
    want = torch.cat([partial_block_amax(x, start, total).flatten() for x, start, total in pieces])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got.isnan().any()


@pytest.mark.parametrize("granularity", [Granularity.MX_1x32, Granularity.ROW_1x128])
@pytest.mark.parametrize("shape", [(4096, 1024), (257, 300), (33, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_triton_dequantize_rows_matches_reference_bit_for_bit(granularity, shape, dtype, monkeypatch):
    """The one-pass dequantization (eager MX and 1x128 operands) equals the torch code's."""
    x = _inputs(shape, torch.float32, seed=7)
    q = quantize(x, E4M3, granularity)
    got = q.dequantize(dtype)
    monkeypatch.setenv("FSDP8_TRITON", "0")
    want = q.dequantize(dtype)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("shape", [(4096, 4096), (300, 257), (64, 32)])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_cast_transpose_matches_reference(shape, fp8, dtype):
    x = _inputs(shape, dtype, 7)
    x[2, 5] = 1.0  # amax must be finite here
    scale = torch.tensor(3.7, device="cuda")
    q, qt, amax, inv = cast_transpose(x, fp8, scale)
    ref = saturate_cast(x, scale, fp8)
    assert _same(q, ref) and _same(qt, ref.t().contiguous())
    assert amax.item() == x.float().abs().max().item() and inv.item() == torch.reciprocal(scale).item()
    # Current scaling: the scale is derived on the device from the amax, as amax_to_scale does.
    q, qt, amax, inv = cast_transpose(x, fp8)
    ref_scale = amax_to_scale(x.float().abs().max(), fp8)
    assert _same(q, saturate_cast(x, ref_scale, fp8)) and inv.item() == torch.reciprocal(ref_scale).item()
    x[1, 1] = float("nan")
    assert torch.isnan(cast_transpose(x, fp8, scale)[2]) and torch.isnan(cast_transpose(x, fp8)[2])


@pytest.mark.parametrize("row_start,rows", [(0, 256), (64, 100), (300, 17)])
def test_triton_rows_with_agreed_grid(row_start, rows):
    total = 512
    x = _inputs((rows, 384), torch.bfloat16, 3)
    x[2, 5] = 0.5
    grid = torch.rand(math.ceil(total / 128), 3, device="cuda") * 100
    got = quantize_rows_with_grid(x, row_start, grid, Granularity.BLOCK_128x128, E4M3)
    block = (torch.arange(rows, device="cuda") + row_start) // 128
    ref = saturate_cast(x, grid[block].repeat_interleave(128, dim=1)[:, :384], E4M3)
    assert _same(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_amaxes_match_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    sizes = [0, 1, 1000, 4096 * 4096 + 3, 5000, 1 << 20]
    tensors = [(torch.randn(n, generator=g, device="cuda") * 10.0 ** (i - 2)).to(dtype) for i, n in enumerate(sizes)]
    tensors[4][1234] = float("nan")
    tensors[5][-1] = -3e4  # the largest magnitude is the last, negative element (29952 in bf16)
    got = amaxes(tensors)  # one Triton launch
    ref = torch.stack([amax(t) for t in tensors])
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.isnan(got[4])
    keep = ~torch.isnan(ref)
    assert torch.equal(got[keep], ref[keep]) and got[0].item() == 0.0
    assert got[5].item() == -tensors[5][-1].float().item()


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("aligned", [True, False])
def test_triton_pieces_match_reference_bit_for_bit(fp8, aligned):
    """One launch for every weight of a unit, bit for bit the per-piece torch reference."""
    shift = 0 if aligned else 3
    src = _inputs((64, 4096), torch.float32, 21).flatten() * 1e-3
    scales = torch.tensor([448.0, 3.5e3, 0.25, 1.0], device="cuda")
    pieces = [(shift, 0, 4096 * 40, 1), (4096 * 40 + 16, 4096 * 40 + shift, 4096 * 20 - 32, 0),
              (4096 * 60, 4096 * 61, 4096 * 3 + 5, 3), (0, 4096 * 64 + 16, 0, 2)]
    out = torch.full((4096 * 65,), 0xAB, dtype=torch.uint8, device="cuda")
    quantize_pieces(src, out.view(fp8), scales, pieces, fp8, via=torch.bfloat16)
    ref = out.clone().fill_(0xAB)
    for s_off, o_off, n, k in pieces:
        q = saturate_cast(src[s_off : s_off + n].to(torch.bfloat16), scales[k], fp8)
        ref[o_off : o_off + n] = q.view(torch.uint8)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("aligned", [True, False])
def test_triton_block_pieces_match_reference_bit_for_bit(fp8, aligned, monkeypatch):
    """A unit's 128x128-scaled weights packed in one launch: bit for bit the torch code
    (FSDP8_TRITON=0), with shards starting inside a scaling block, ragged tiles and columns,
    an empty piece, and nothing written between pieces."""
    shift = 0 if aligned else 3
    cols_b = 1024 if aligned else 1000
    src = _inputs((1024, 1024), torch.float32, 23).flatten() * 1e-3
    src[1::2] = src[1::2].to(torch.bfloat16).float() * (1 + 2.0**-9)  # rounding to bf16 first matters
    scales = torch.rand(256, device="cuda") * 1e4
    pieces = [(shift, 16, 300, 1024, 100, 0),  # rows 100..399: grid rows 0-3, 8 columns -> 32 scales
              (300 * 1024 + 64, 300 * 1024 + 32 + shift, 257, cols_b, 0, 32),  # 3 x 8 grid
              (600 * 1024, 600 * 1024, 40, 2048, 256, 64),  # rows 256..295: grid row 2 of a 16-wide grid
              (0, 1024 * 1024 - 64, 0, 128, 0, 255)]
    out = torch.full((1024 * 1024,), 0xAB, dtype=torch.uint8, device="cuda")
    quantize_block_pieces(src, out.view(fp8), scales, pieces, fp8, via=torch.bfloat16)
    monkeypatch.setenv("FSDP8_TRITON", "0")
    ref = torch.full_like(out, 0xAB)
    quantize_block_pieces(src, ref.view(fp8), scales, pieces, fp8, via=torch.bfloat16)
    assert torch.equal(out, ref)


def test_triton_amaxes_reuse_their_pointer_table_without_going_stale():
    """The second call on the same tensors reuses the uploaded pointer table (no host sync)
    and still sees the tensors' new values; other tensors get a table of their own."""
    tensors = [torch.ones(1000, device="cuda"), torch.ones(3000, device="cuda")]
    assert amaxes(tensors).tolist() == [1.0, 1.0]
    tensors[0].mul_(7.0)
    tensors[1][2999] = -9.0
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = amaxes(tensors)
    assert got.tolist() == [7.0, 9.0]
    assert not [e for e in prof.events() if e.name in ("aten::_to_copy", "aten::copy_")], "a cached table needs no upload"
    others = [torch.full((10,), 2.0, device="cuda"), torch.full((5,), -4.0, device="cuda")]
    assert amaxes(others).tolist() == [2.0, 4.0]


@pytest.mark.parametrize("granularity", [Granularity.TENSOR, Granularity.BLOCK_128x128])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("shape,row_start", [((300, 384), 100), ((4096, 1024), 0), ((17, 130), 250)])
def test_triton_rows_through_compute_dtype_into_buffer(granularity, fp8, shape, row_start, monkeypatch):
    """The engine's pack: fp32 main rows -> bf16 -> scaled -> FP8, written into a send-buffer
    region in one pass; bit for bit the torch reference, nothing written outside the region."""
    rows = _inputs(shape, torch.float32, 11) * 1e-3
    rows[2, 5] = 0.25
    # fp32 values half a bf16 step above bf16 values: rounding to bf16 first matters.
    rows[1::2] = rows[1::2].to(torch.bfloat16).float() * (1 + 2.0**-9)
    total = row_start + shape[0]
    if granularity is Granularity.TENSOR:
        scale = torch.tensor(300.0, device="cuda")
    else:
        scale = torch.rand(math.ceil(total / 128), math.ceil(shape[1] / 128), device="cuda") * 1e4
    numel = shape[0] * shape[1]
    buffer = torch.full((numel + 64,), 0xAB, dtype=torch.uint8, device="cuda")
    region = buffer[32 : 32 + numel].view(fp8).view(shape)
    quantize_rows_with_grid(rows, row_start, scale, granularity, fp8, via=torch.bfloat16, out=region)
    monkeypatch.setenv("FSDP8_TRITON", "0")
    ref = quantize_rows_with_grid(rows, row_start, scale, granularity, fp8, via=torch.bfloat16)
    assert _same(region, ref)
    assert (buffer[:32] == 0xAB).all() and (buffer[-32:] == 0xAB).all()


@pytest.mark.parametrize("recipe_name", ["fp8-current", "fp8-delayed", "fp8-block", "fp8-mxfp8"])
def test_native_gemm_close_to_emulated(recipe_name):
    """_scaled_mm and the emulated GEMM see identical FP8 operands; they differ only in
    accumulation order, far below FP8 rounding (bound 1e-2 relative)."""
    from fsdp8.fp8 import gemm
    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.fp8.recipes import recipe_from_name

    recipe = recipe_from_name(recipe_name)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16)
    convert_to_fp8(lin, recipe)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    outs = []
    original = gemm.native_ok
    for native in (True, False):
        gemm.native_ok = original if native else (lambda a, b, r, out_dtype: False)
        try:
            lin.zero_grad(set_to_none=True)
            x.grad = None
            if lin._delayed is not None:
                lin._delayed = None  # same (fresh) delayed state for both runs
            y = lin(x)
            y.backward(dy)
            outs.append((y.float(), x.grad.float(), lin.weight.grad.float()))
        finally:
            gemm.native_ok = original
    native_used = original(gemm.quantize(x.detach(), recipe.fwd_dtype, recipe.x_granularity),
                           gemm.quantize(lin.weight.detach(), recipe.fwd_dtype, recipe.w_granularity), recipe,
                           torch.bfloat16)
    for a, b in zip(*outs):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    assert native_used == (recipe_name != "fp8-mxfp8")  # MX needs sm100; Hopper emulates it


@pytest.mark.parametrize("recipe_name", ["fp8-current", "fp8-block", "fp8-mxfp8"])
def test_fp64_gemm_is_exact_on_every_recipe(recipe_name):
    """A model computing in fp64 (the FP8 parity tests) gets fp64 products on CUDA as on CPU:
    the GEMM of two quantized operands equals the fp64 product of their dequantized values to
    fp64 rounding, never the bf16 output of the MX emulation (2^-8 relative)."""
    from fsdp8.fp8 import gemm
    from fsdp8.fp8.recipes import recipe_from_name

    recipe = recipe_from_name(recipe_name)
    torch.manual_seed(0)
    a = gemm.quantize(torch.randn(256, 512, device="cuda", dtype=torch.float64), recipe.fwd_dtype, recipe.x_granularity)
    b = gemm.quantize(torch.randn(128, 512, device="cuda", dtype=torch.float64), recipe.fwd_dtype, recipe.w_granularity)
    out = gemm.fp8_mm(a, b, torch.float64, recipe)
    exact = a.dequantize(torch.float64).cpu() @ b.dequantize(torch.float64).cpu().t()
    assert out.dtype == torch.float64
    assert ((out.cpu() - exact).norm() / exact.norm()).item() < 1e-12


@pytest.mark.parametrize("shape", [(4096, 1024), (300, 257)])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_1x128_both_ways_matches_reference(shape, fp8, dtype):
    """Bit for bit the torch code's, NaN, zero and infinite blocks included (the kernel finds
    amaxes as integer maxima of |x|'s bits and leaves saturation to sm89+'s casts)."""
    from fsdp8.fp8.kernels import quantize_1x128_both_ways

    x = _inputs(shape, dtype, 11)
    x[-1, -1] = -float("inf")  # saturates to -FMAX both ways, as clamping does
    rows, cols = quantize_1x128_both_ways(x, fp8)
    ref_rows = quantize_reference(x, fp8, Granularity.ROW_1x128)
    ref_cols = quantize_reference(x.t(), fp8, Granularity.ROW_1x128)
    for got, ref in ((rows, ref_rows), (cols, ref_cols)):
        assert _same(got.data, ref.data)
        assert torch.allclose(got.scale_inv, ref.scale_inv, rtol=0, atol=0, equal_nan=True)
        # Written outer-dimension-major, as cuBLAS reads them: fp8_mm copies nothing.
        assert got.scale_inv.stride() == (1, got.scale_inv.shape[0])


@pytest.mark.parametrize("shape", [(4096, 1024), (300, 257)])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_1x128_both_ways_in_a_compiled_graph_is_the_triton_op(shape, fp8, dtype, monkeypatch):
    """Under torch.compile the both-ways quantization is fsdp8's Triton kernel as one op of
    the graph (no graph break: fullgraph), fed by a fused producer, with the reference's bytes;
    FSDP8_TRITON_OP=0 gives Inductor's own kernels, the same bytes."""
    from fsdp8.fp8.kernels import quantize_1x128_both_ways

    x = _inputs(shape, dtype, 12)

    def fn(t):
        rows, cols = quantize_1x128_both_ways(t * 2.0, fp8)  # a producer to fuse or materialize
        return rows.data, rows.scale_inv, cols.data, cols.scale_inv

    ref_rows = quantize_reference(x * 2.0, fp8, Granularity.ROW_1x128)
    ref_cols = quantize_reference((x * 2.0).t(), fp8, Granularity.ROW_1x128)
    for op in ("1", "0"):
        monkeypatch.setenv("FSDP8_TRITON_OP", op)
        torch._dynamo.reset()
        backend = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        got = torch.compile(fn, fullgraph=True, backend=backend)(x)
        calls = [n for g in backend.graphs for n in g.graph.nodes if "quantize_1x128_both_ways" in str(n.target)]
        assert len(calls) == (1 if op == "1" else 0)
        for data, scale_inv, ref in ((got[0], got[1], ref_rows), (got[2], got[3], ref_cols)):
            assert _same(data, ref.data)
            assert torch.allclose(scale_inv, ref.scale_inv, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(4096, 1024), (384, 257), (300, 257)])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_1x128_transposed_in_a_compiled_graph_matches_reference(shape, fp8, dtype):
    """A linear's input transposed for the weight gradient (quantize_transposed) inside a
    compiled graph, fed by a producer (Inductor's kernels, from 128x1 column blocks where the
    rows are whole blocks): the bytes of quantizing the materialized transpose. NaN, zero and
    infinite blocks included."""
    from fsdp8.fp8.kernels import quantize_transposed

    x = _inputs(shape, dtype, 13)
    x[-1, 0] = -float("inf")

    def fn(t):
        q = quantize_transposed(t * 2.0, fp8, Granularity.ROW_1x128)
        return q.data, q.scale_inv

    ref = quantize_reference((x * 2.0).t().contiguous(), fp8, Granularity.ROW_1x128)
    torch._dynamo.reset()
    data, scale_inv = torch.compile(fn, fullgraph=True)(x)
    assert _same(data, ref.data)
    assert torch.allclose(scale_inv, ref.scale_inv, rtol=0, atol=0, equal_nan=True)


def _delayed_as_under_the_engine(module, x, dy):
    """Delayed scaling as the engine runs it: the state is updated outside the linear (so a
    compiled one is traced, reading the scales' kept inverses, which reach cuBLAS as its
    scale pointers), from the amaxes of one step first, so the scales are not the initial 1."""
    from fsdp8.fp8.recipes import update_delayed_states

    module.external_delayed_update = True
    module(x.clone().requires_grad_(True)).backward(dy)
    module.weight.grad = None
    update_delayed_states([module.delayed_state(x.device)])


@pytest.mark.parametrize("recipe_name", ["fp8-current", "fp8-delayed", "fp8-block", "fp8-mxfp8"])
def test_compiled_float8_linear_matches_eager_with_native_gemm(recipe_name):
    """A Float8Linear traced by torch.compile (compiler-generated quantization feeding
    _scaled_mm, which Inductor may run as its own GEMM) against eager (Triton kernels, cuBLAS).
    Both quantize the same bf16 values with the same fp32 formulas, rounding to nearest even,
    so the FP8 operands agree; the GEMMs may accumulate in another order, and their bf16
    results then differ by at most one bf16 ulp (2**-8 relative) per element: the bound is
    2**-8 of the norm. FP8 itself sits several percent from the bf16 layer (e4m3 rounds
    by up to 2**-4), checked against 1e-2 so the test can tell FP8 from no FP8. Delayed
    scaling runs as under the engine (_delayed_as_under_the_engine)."""
    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.fp8.recipes import recipe_from_name

    def layer():
        torch.manual_seed(0)
        return torch.nn.Linear(1024, 512, bias=False, device="cuda", dtype=torch.bfloat16)

    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for kind in ("eager", "compiled", "bf16"):
        module = layer()
        if kind != "bf16":
            convert_to_fp8(module, recipe_from_name(recipe_name))
        if kind != "bf16" and recipe_name == "fp8-delayed":
            _delayed_as_under_the_engine(module, x, dy)
        traced = recipe_from_name(recipe_name).traceable
        run = torch.compile(module, fullgraph=traced) if kind == "compiled" else module
        xi = x.clone().requires_grad_(True)
        out = run(xi)
        out.backward(dy)
        results.append([t.float() for t in (out, xi.grad, module.weight.grad)])
    (eager, compiled, plain) = results
    for got, want, bf16 in zip(compiled, eager, plain):
        assert (got - want).norm() <= 2**-8 * want.norm()
        assert (want - bf16).norm() > 1e-2 * bf16.norm()
