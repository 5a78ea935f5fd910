"""Pure layout and chunk-ownership math."""


import pytest
import torch

from fsdp8.engine.layout import ceil_div, plan_unit, round_up
from fsdp8.engine.topology import ChunkPlan


@pytest.mark.parametrize("rows,n", [(17, 4), (3, 4), (8, 2), (1, 4), (9, 1), (5, 3)])
def test_chunks_follow_torch_chunk(rows, n):
    layout = plan_unit([(rows, 5)], 1, n)
    p = layout.params[0]
    expected = [c.shape[0] for c in torch.arange(rows * 5).view(rows, 5).chunk(n)]
    expected += [0] * (n - len(expected))  # torch.chunk drops trailing empty chunks
    got = [p.chunk_row_range(k)[1] - p.chunk_row_range(k)[0] for k in range(n)]
    assert got == expected
    assert p.is_torch_chunk
    assert p.chunk_rows == ceil_div(rows, n)


def test_offsets_sizes_and_trainable_prefix():
    layout = plan_unit([(17, 3), (4,), (2, 2, 2)], num_trainable=2, num_chunks=4)
    a, b, c = layout.params
    assert [p.chunk_numel for p in layout.params] == [5 * 3, 1, 1 * 4]
    assert [p.offset for p in layout.params] == [0, 15, 16]
    assert layout.chunk_numel == 20 and layout.trainable_numel == 16
    assert layout.unsharded_numel == 80
    assert [p.unsharded_offset for p in layout.params] == [0, 60, 64]
    assert layout.numel == 17 * 3 + 4 + 8


def test_gather_then_copy_out_reassembles_every_parameter():
    """Simulate the engine's data path with plain tensors: chunk, 'all-gather', copy out."""
    shapes = [(17, 3), (3,), (5, 2, 2)]
    n = 4
    layout = plan_unit(shapes, len(shapes), n)
    full = [torch.randn(s) for s in shapes]
    chunks = []
    for k in range(n):
        chunk = torch.zeros(layout.chunk_numel)
        for p, t in zip(layout.params, full):
            start, stop = p.chunk_row_range(k)
            piece = t[start:stop].reshape(-1)
            chunk[p.offset : p.offset + piece.numel()] = piece
        chunks.append(chunk)
    gathered = torch.stack(chunks)  # rank-major [n, M], what all_gather returns
    unsharded = torch.empty(layout.unsharded_numel)
    outs = [unsharded[p.unsharded_offset : p.unsharded_offset + p.padded_numel].view(1, n, p.chunk_numel) for p in layout.params]
    torch.split_with_sizes_copy(gathered.view(1, n, -1), list(layout.split_sizes), dim=2, out=outs)
    for p, t in zip(layout.params, full):
        got = unsharded[p.unsharded_offset : p.unsharded_offset + p.numel].view(p.shape)
        assert torch.equal(got, t)


def test_chunk_cat_matches_layout():
    """torch._chunk_cat packs gradients exactly as the layout chunks parameters."""
    shapes = [(17, 3), (3,)]
    layout = plan_unit(shapes, 2, 4)
    grads = [torch.randn(s) for s in shapes]
    packed = torch.empty(4, layout.trainable_numel)
    torch._chunk_cat(grads, dim=0, num_chunks=4, out=packed)
    for k in range(4):
        for p, g in zip(layout.params, grads):
            start, stop = p.chunk_row_range(k)
            piece = g[start:stop].reshape(-1)
            assert torch.equal(packed[k, p.offset : p.offset + piece.numel()], piece)
            assert torch.all(packed[k, p.offset + piece.numel() : p.offset + p.chunk_numel] == 0)


def test_row_multiple_rounds_chunks_for_block_scales():
    p = plan_unit([(1000, 4)], 1, 4, row_multiple=128).params[0]
    assert p.chunk_rows == 256 and not p.is_torch_chunk
    assert p.chunk_row_range(3) == (768, 1000)
    assert round_up(250, 128) == 256


def test_bad_layouts():
    with pytest.raises(ValueError, match="0-dim"):
        plan_unit([()], 1, 2)
    with pytest.raises(ValueError, match="num_chunks"):
        plan_unit([(3,)], 1, 0)
    with pytest.raises(IndexError):
        plan_unit([(3,)], 1, 2).params[0].chunk_row_range(2)


@pytest.mark.parametrize("inner,outer,expected", [
    (True, False, [0, 1, 0, 1]),
    (False, True, [0, 0, 1, 1]),
    (True, True, [0, 1, 2, 3]),
    (False, False, [0, 0, 0, 0]),
])
def test_chunk_index_is_row_major_over_sharded_dims(inner, outer, expected):
    got = [ChunkPlan(2, 2, r, s, inner, outer).chunk_index for r in range(2) for s in range(2)]
    assert got == expected
    assert ChunkPlan(2, 2, 0, 0, inner, outer).num_chunks == (2 if inner else 1) * (2 if outer else 1)


def test_chunk_alignment_pads_the_end_of_every_chunk():
    layout = plan_unit([(5, 3), (4,)], 2, 2, chunk_align=16)
    assert sum(p.chunk_numel for p in layout.params) == 3 * 3 + 2
    assert layout.chunk_numel == 16 and layout.padding == 5
    assert layout.split_sizes == (9, 2, 5) and layout.unsharded_numel == 32
