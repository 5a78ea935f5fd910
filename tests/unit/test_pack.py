"""pack_rank_major writes exactly what torch._chunk_cat writes, on every path."""

import pytest
import torch

from fsdp8.engine.layout import plan_unit
from fsdp8.engine.pack import pack_rank_major

SHAPES = [
    [(8, 4), (16,)],  # even
    [(17, 3), (3,), (5, 2, 2)],  # uneven: short and empty last chunks, 3-D
    [(1, 7), (130, 2)],  # fewer rows than chunks
]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("max_pieces", [256, 0])  # foreach pieces / one strided copy per gradient
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_pack_matches_chunk_cat(shapes, n, max_pieces, dtypes):
    src, dst = dtypes
    layout = plan_unit(shapes, len(shapes), n)
    g = torch.Generator().manual_seed(n)
    grads = [torch.randn(s, generator=g).to(src) for s in shapes]
    expected = torch.empty(n, layout.trainable_numel, dtype=dst)
    torch._chunk_cat(grads, dim=0, num_chunks=n, out=expected)
    got = torch.full((n, layout.trainable_numel), float("nan"), dtype=dst)  # padding must be written
    pack_rank_major(grads, layout.params, got, max_pieces=max_pieces)
    assert torch.equal(got, expected)


def test_pack_covers_trainable_prefix_only():
    """Frozen parameters sit after the trainable ones and get no gradient columns."""
    layout = plan_unit([(6, 2), (4,), (9, 9)], 2, 2)
    grads = [torch.randn(6, 2), torch.randn(4)]
    out = torch.empty(2, layout.trainable_numel)
    pack_rank_major(grads, layout.params[:2], out)
    assert out.shape[1] == 6 + 2 and torch.equal(out[1, :6], grads[0][3:].reshape(-1))


def test_pack_rejects_mismatched_input():
    layout = plan_unit([(8, 4)], 1, 2)
    out = torch.empty(2, layout.trainable_numel)
    with pytest.raises(ValueError, match="does not match its layout"):
        pack_rank_major([torch.randn(4, 8)], layout.params, out)
    with pytest.raises(ValueError, match="1 gradients for 2"):
        pack_rank_major([torch.randn(8, 4)], layout.params * 2, out)
    with pytest.raises(ValueError, match="contiguous"):
        pack_rank_major([torch.randn(8, 4)], layout.params, out.t())
