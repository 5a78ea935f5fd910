"""FP8 expert weights on the engine's wire (fsdp8/engine/fp8_experts.py), single process on CPU:
the ranks' amaxes, agreed scales and packed bytes, simulated chunk by chunk, are the bytes and
scales fp8_grouped_mm makes from the whole weight, and fp8_grouped_mm on such a gathered 3-D
Float8Tensor computes exactly what it computes from the high-precision weight."""

from types import SimpleNamespace

import pytest
import torch

from fsdp8.engine.fp8_experts import expert_placement
from fsdp8.engine.layout import plan_unit
from fsdp8.fp8.formats import Granularity
from fsdp8.fp8.grouped import fp8_grouped_mm, grouped_weights
from fsdp8.fp8.kernels import quantize, scales_for
from fsdp8.fp8.recipes import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from fsdp8.fp8.tensor import Float8Tensor
from fsdp8.fp8.weight_kernels import amaxes, block_amax_grids, quantize_block_pieces, quantize_pieces

RECIPES = [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()]
ids = lambda r: r.name  # noqa: E731
# 5 experts over 3 chunks (2, 2, 1 experts), 48 rows: a partial 128-row block per expert.
EXPERTS, N, K = 5, 48, 160


class _Inner:
    """This ep rank's experts of a weight of ``total`` experts (an InnerSpec's region)."""

    def __init__(self, total: int, first: int):
        self.shape, self.first = (total, N, K), first

    def local_region(self):
        return (EXPERTS, N, K), (self.first, 0, 0)


def _slot(chunks: int, inner=None):
    return SimpleNamespace(layout=plan_unit([(EXPERTS, N, K)], 1, chunks).params[0], inner=inner)


def wire(w: torch.Tensor, chunks: int, recipe, inner=None):
    """What the engine's ranks make of ``w`` [EXPERTS, N, K] cut into ``chunks`` (the max all-reduce
    as a max over the chunks' amaxes): the gathered bytes [EXPERTS, N, K] and scale_inv."""
    g, fp8 = recipe.w_granularity, recipe.fwd_dtype
    slot = _slot(chunks, inner)
    placements = [expert_placement(slot, k) for k in range(chunks)]
    rows = [w[slice(*p.held)].contiguous() for p in placements]
    if g is Granularity.MX_1x32:  # nothing agreed: each chunk's rows with their own 1x32 scales
        qs = [quantize(r.reshape(-1, K), fp8, g) for r in rows]
        return (torch.cat([q.data for q in qs]).view(w.shape),
                torch.cat([q.scale_inv for q in qs]).view(placements[0].scale_shape(g)))
    if g is Granularity.TENSOR:
        local = [amaxes(p.amax_inputs(r)) for p, r in zip(placements, rows)]
    else:
        local = [block_amax_grids(p.grid_pieces(r)) for p, r in zip(placements, rows)]
    agreed = torch.stack(local).amax(0)
    scale, inv = scales_for(agreed, g, fp8)
    pick = placements[0].picks(g, 0)
    scale, inv = scale[pick], inv[pick]
    data = []
    for p, r in zip(placements, rows):
        out = torch.empty(r.numel(), dtype=fp8, device=w.device)
        pack = quantize_pieces if g is Granularity.TENSOR else quantize_block_pieces
        pack(r.flatten(), out, scale, p.pack_pieces(g, 0, 0, 0), fp8)
        data.append(out.view(r.shape))
    return torch.cat(data), inv.view(placements[0].scale_shape(g))


@pytest.mark.parametrize("inner", [None, _Inner(3 * EXPERTS, EXPERTS)], ids=["whole", "ep-rank-1-of-3"])
@pytest.mark.parametrize("recipe", RECIPES, ids=ids)
def test_ranks_pack_the_bytes_and_scales_grouped_mm_makes(recipe, inner):
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-3, 1.0, 30.0, 0.0, 1e3])[:, None, None]  # an all-zero expert too
    w = torch.randn(EXPERTS, N, K, generator=g) * magnitudes
    want = grouped_weights(w, recipe.fwd_dtype, recipe.w_granularity)
    data, inv = wire(w, 3, recipe, inner)
    for e, q in enumerate(want):
        assert torch.equal(data[e].view(torch.uint8), q.data.view(torch.uint8)), e
        assert torch.equal(inv[e], q.scale_inv), e


def test_an_expert_not_held_contributes_zeros_at_its_global_place():
    slot = _slot(3, _Inner(2 * EXPERTS, EXPERTS))
    p = expert_placement(slot, 2)  # chunk 2 holds expert 4 of this ep rank, expert 9 of the whole
    assert (p.held, p.first, p.total) == ((4, 5), EXPERTS, 2 * EXPERTS)
    w = torch.ones(1, N, K)
    assert amaxes(p.amax_inputs(w)).tolist() == [0.0] * 9 + [1.0]
    assert p.picks(Granularity.TENSOR, 100).tolist() == list(range(105, 110))
    grids = block_amax_grids(p.grid_pieces(w)).view(2 * EXPERTS, 1, 2)
    assert grids[:9].abs().sum() == 0 and grids[9].eq(1).all()
    assert p.pack_pieces(Granularity.TENSOR, 7, 3, 20) == [(7, 3, N * K, 24)]
    assert p.pack_pieces(Granularity.BLOCK_128x128, 7, 3, 20) == [(7, 3, N, K, 0, 20 + 4 * 2)]


@pytest.mark.parametrize("recipe", RECIPES, ids=ids)
def test_grouped_mm_on_gathered_bytes_is_grouped_mm_on_the_weight(recipe):
    g = torch.Generator().manual_seed(1)
    sizes = [3, 0, 40, 7, 1]
    x = torch.randn(sum(sizes), K, generator=g, dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, N, K, generator=g, dtype=torch.bfloat16)
    dy = torch.randn(sum(sizes), N, generator=g, dtype=torch.bfloat16)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    data, inv = wire(w.float(), 2, recipe)
    gathered = torch.nn.Parameter(Float8Tensor(data, inv, recipe.w_granularity, torch.bfloat16))
    results = []
    for weight in (w.clone().requires_grad_(), gathered):
        xi = x.clone().requires_grad_()
        out = fp8_grouped_mm(xi, weight, offs, recipe)
        results.append((out, *torch.autograd.grad(out, (xi, weight), dy)))
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype and torch.equal(got, want)
