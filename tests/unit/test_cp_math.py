"""Context parallelism's pure pieces: head-tail chunks, positions, cutting and joining, the local attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fsdp8.parallel import cp


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_chunks_cover_the_sequence_once_and_balance_causal_work(n):
    held = [c for r in range(n) for c in cp.rank_chunks(r, n)]
    assert sorted(held) == list(range(2 * n))
    # Keys a rank's queries see under causal attention, in chunks: (c + 1) per chunk c.
    assert len({sum(c + 1 for c in cp.rank_chunks(r, n)) for r in range(n)}) == 1
    assert cp.rank_chunks(0, n) == (0, 2 * n - 1)


def test_chunk_sources_invert_rank_chunks():
    for n in (1, 2, 3, 4):
        for c, (r, j) in enumerate(cp.chunk_sources(n)):
            assert cp.rank_chunks(r, n)[j] == c
    assert cp.chunk_sources(2) == [(0, 0), (1, 0), (1, 1), (0, 1)]


def test_rank_positions():
    assert cp.rank_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp.rank_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp.rank_positions(8, 3, 4).tolist() == [3, 4]
    every = torch.cat([cp.rank_positions(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("n, dim", [(1, 1), (2, 1), (3, 1), (4, -1), (2, 0)])
def test_shard_and_unshard_round_trip(n, dim):
    x = torch.arange(2 * 5 * 8 * n * 3).view(2, 5, 8 * n, 3).movedim(2, dim if dim >= 0 else 3)
    seq_dim = dim if dim >= 0 else 3
    parts = [cp.shard_tensor(x, r, n, dim=seq_dim) for r in range(n)]
    assert all(p.shape[seq_dim] == x.shape[seq_dim] // n for p in parts)
    assert torch.equal(cp.unshard_tensor(parts, dim=seq_dim), x)


def test_shard_tensor_holds_rank_positions():
    seq = torch.arange(24).view(1, 24)
    for r in range(3):
        assert torch.equal(cp.shard_tensor(seq, r, 3)[0], cp.rank_positions(24, r, 3))


def test_shift_labels():
    labels = torch.tensor([[5, 6, 7, -100], [1, 2, 3, 4]])
    assert cp.shift_labels(labels).tolist() == [[6, 7, -100, -100], [2, 3, 4, -100]]


@pytest.mark.parametrize("seq_len, n, tp, ok", [
    (16, 2, 1, True), (6, 2, 1, False), (12, 2, 1, True), (9, 3, 1, False), (18, 3, 1, True),
    (12, 2, 2, True),  # 6 tokens per cp rank, 3 per tp rank
    (12, 2, 4, False), (24, 2, 4, True), (18, 3, 3, True), (12, 3, 3, False),
])
def test_check_sequence_length(seq_len, n, tp, ok):
    if ok:
        cp.check_sequence_length(seq_len, n, tp)
        return
    with pytest.raises(ValueError, match=rf"sequence length {seq_len} is not divisible by {n * cp.local_multiple(n, tp)}"):
        cp.check_sequence_length(seq_len, n, tp)


def test_sequence_length_message_names_the_fix():
    with pytest.raises(ValueError) as info:
        cp.check_sequence_length(6, 2, 2)
    assert str(info.value) == (
        "sequence length 6 is not divisible by 4: context parallelism over cp=2 ranks cuts every sequence into "
        "2 x cp = 4 equal chunks (two per rank, so causal work is balanced), and sequence parallelism splits each "
        "rank's part over tp=2; pad or cut sequences to a multiple of 4")


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attend_chunks_equals_causal_attention_of_the_whole_sequence(n, kv_heads):
    # Each rank's two query chunks against the whole sequence's keys (no communication)
    # equal those rows of full causal attention: the masks are right at every chunk boundary.
    torch.manual_seed(0)
    seq, heads = 8 * n, 4
    q = torch.randn(2, heads, seq, 16, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, seq, 16, dtype=torch.float64) for _ in range(2))
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kv_heads, 1),
                                          v.repeat_interleave(heads // kv_heads, 1), is_causal=True)
    parts = [cp.attend_chunks(cp.shard_tensor(q, r, n, dim=2), k, v, r, n) for r in range(n)]
    assert torch.allclose(cp.unshard_tensor(parts, dim=2), full, rtol=1e-12, atol=1e-12)


def test_global_order_reassembles_gathered_parts():
    n, shape = 3, (2, 2, 12, 4)
    whole = torch.randn(shape)
    gathered = torch.stack([cp.shard_tensor(whole, r, n, dim=2).reshape(-1) for r in range(n)])
    for r in range(n):
        seen = (max(cp.rank_chunks(r, n)) + 1) * 2
        assert torch.equal(cp._global_order(gathered, torch.Size(shape[:2] + (4, 4)), r, n), whole[:, :, :seen])


def test_attend_chunks_gradients_match():
    torch.manual_seed(1)
    n, seq = 2, 16
    q, k, v = (torch.randn(1, 2, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    parts = [cp.attend_chunks(cp.shard_tensor(q, r, n, dim=2), k, v, r, n) for r in range(n)]
    cp.unshard_tensor(parts, dim=2).square().sum().backward()
    for got, expected in zip((q.grad, k.grad, v.grad), want):
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
