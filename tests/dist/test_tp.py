"""Tensor parallelism (TP only, no fully_shard) against one process, gloo at 2 and 4 ranks; plan and mesh checks.

Tolerances, derived:
- fp32: TP reorders sums (row-parallel partial sums all-reduced, vocabulary-parallel
  log-softmax); each fp32 run is within 4-7e-7 of the float64 gradients (measured on two
  machines: the q/k projection gradients are small differences of large terms), so
  two runs differ by up to ~1.4e-6 (1.1e-6 the most measured), and SGD (linear in the
  gradients) keeps the updated weights that close: 3e-6. Each step starts the reference from
  the TP weights (tp_workers.compare_training), so earlier steps' rounding is not amplified
  into these bounds.
- bf16 (the built-in Llama's CPU bf16 GEMM path on DTensors): row-parallel partial sums are
  rounded to bf16 before their all-reduce where one process rounds once, ~2^-8 relative
  per element, amplified by the same cancellations (measured 1.7e-2): 5e-2.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fsdp8.parallel.tp import resolve_plan
from tests.dist import tp_workers
from tests.harness import run_on_ranks

FP32_TOL = 3e-6
BF16_TOL = 5e-2
SEQ = 8  # tp_workers' batches


def _check(results, tol, tp, sequence_parallel):
    for errors, seen in results:
        bad = {k: v for k, v in errors.items() if not v <= tol}
        assert errors and not bad, f"off by more than {tol:g} relative: {bad}"
        assert seen == [SEQ // tp if sequence_parallel else SEQ]  # a layer's input is sequence-sharded under SP


@pytest.mark.parametrize(
    "world, tp, sp, lp, model_kw",
    [
        (2, 2, False, False, {}),
        (2, 2, True, False, {}),
        (2, 2, False, True, {}),
        (2, 2, True, True, {"tie_embeddings": True}),
        (2, 2, False, True, {"vocab_size": 63, "tie_embeddings": True}),  # uneven vocabulary shards
        (2, 2, True, True, {"checkpoint_activations": True}),
        (4, 4, True, True, {"n_kv_heads": 4, "vocab_size": 63, "tie_embeddings": True}),
        (4, 4, False, False, {"n_kv_heads": 4}),
        (4, 2, True, True, {}),  # two TP groups, each fed the same batch
    ],
)
def test_llama_parity(world, tp, sp, lp, model_kw):
    _check(run_on_ranks(world, tp_workers.llama_parity, tp, sp, lp, model_kw), FP32_TOL, tp, sp)


def test_llama_bf16_linear_on_dtensors():
    _check(run_on_ranks(2, tp_workers.llama_parity, 2, True, True, {"dtype": torch.bfloat16}), BF16_TOL, 2, True)


@pytest.mark.parametrize(
    "world, family, sp, lp, model_kw",
    [
        (2, "llama", False, False, {}),
        (2, "llama", True, True, {"tie": True}),
        (2, "llama", False, True, {"vocab": 127, "tie": True}),
        (2, "qwen2", True, True, {}),
        (4, "llama", True, True, {"kv_heads": 4}),
    ],
)
def test_hf_parity(world, family, sp, lp, model_kw):
    pytest.importorskip("transformers")
    _check(run_on_ranks(world, tp_workers.hf_parity, world, family, sp, lp, model_kw), FP32_TOL, world, sp)


BAD = {
    "kv_heads": "tp=2 must divide n_kv_heads=1 (each rank computes whole heads); no tp > 1 divides them all",
    "heads": "tp=2 must divide n_heads=3 and n_kv_heads=3 (each rank computes whole heads); use tp in (1, 3), "
             "which divide them all",
    # The head counts (4 and 2) allow no tp that the feed-forward's 49 allows.
    "ffn": "tensor_parallel: tp=2 must divide the split dims 49 (layers.*.ffn.w1, layers.*.ffn.w3, layers.*.ffn.w2); "
           "no tp > 1 divides them all",
    "unknown_key": "plan key 'layers.*.attn.wz' matches no module",
    "not_a_style": "plan['head'] must be a torch ParallelStyle",
    "no_plan": "no automatic tensor-parallel plan for Sequential",
    "uneven_features": "tp=2 must divide the split dims 15 (0); use tp in (1, 3, 5, 15)",
    "tied_split": "tied parameter placed differently by the plan: embed.weight as Shard(dim=0), head.weight as a "
                  "plain tensor",
    "hf_kv_heads": "tp=2 must divide num_key_value_heads=1",
    "hf_unsupported": "model.layers.*.self_attn.q_proj ('packed_colwise')",
    "two_d_mesh": "tp_mesh must be a 1-D DeviceMesh",
    "twice": "Llama already has DTensor parameters (embed.weight, layers.0.attn_norm.weight, layers.0.attn.wq.weight",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_on_every_rank_before_any_collective(name):
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    for message, distributed in run_on_ranks(2, tp_workers.bad_input, name):
        assert message is not None and BAD[name] in message, message
        assert not distributed  # nothing was scattered: the check came first


def test_sequence_parallel_needs_divisible_sequence():
    for message in run_on_ranks(2, tp_workers.sequence_not_divisible):
        assert message is not None and "sequence length 5 is not divisible by tp=2" in message


def test_plan_overrides():
    for llama_err, llama_plain, mlp_err, mlp_plain in run_on_ranks(2, tp_workers.plan_overrides):
        assert llama_err <= FP32_TOL and mlp_err <= FP32_TOL
        ffn = [n for n in llama_plain if ".ffn." in n]
        assert len(ffn) == 6 and not [n for n in llama_plain if ".attn." in n or n in ("embed.weight", "head.weight")]
        assert mlp_plain == ["3.weight", "3.bias"]


def test_meta_model_keeps_tie_and_allocates_nothing():
    results = run_on_ranks(2, tp_workers.meta_model)
    assert [local_shape for _, local_shape, _, _ in results] == [(32, 32), (31, 32)]  # vocab 63: uneven rows
    for placements, _, tied, allocated in results:
        assert placements == ("Shard(dim=0)",) and tied and not allocated


def test_resolve_plan_order_overrides_and_none():
    names = ["embed", "layers.0.attn.wq", "layers.0.ffn.w1", "layers.1.attn.wq", "head"]
    a, b, c = ColwiseParallel(), RowwiseParallel(), ColwiseParallel()
    resolved = resolve_plan(names, {"head": a, "layers.*.attn.wq": a, "embed": b},
                            {"layers.1.*": c, "embed": None})
    assert list(resolved) == ["layers.0.attn.wq", "layers.1.attn.wq", "head"]
    assert resolved["layers.0.attn.wq"] is a and resolved["layers.1.attn.wq"] is c


def test_mesh_layouts():
    world = 4
    ranks = torch.arange(world)
    for rank, per_rank in enumerate(run_on_ranks(world, tp_workers.mesh_layouts)):
        for kwargs, (names, shape, dp_names, dp_ranks, tp_ranks, dp_group_size) in zip(tp_workers.MESH_CASES, per_rank):
            assert names[-1] != "tp" or "tp" in kwargs
            grid = ranks.view(shape)
            coord = [int(c) for c in (grid == rank).nonzero()[0]]
            where = dict(zip(names, coord))
            if "tp" in names:  # TP innermost: neighbouring ranks
                assert tp_ranks == [rank - where["tp"] + i for i in range(shape[-1])]
            else:
                assert tp_ranks is None
            # The dp mesh: every dp dim free, cp folded into the shard dim, tp fixed.
            index = tuple(slice(None) if n in ("dp_replicate", "dp_shard", "cp") else where[n] for n in names)
            dp = grid[index]
            if "cp" in names:
                dp = dp.flatten(-2)
            assert dp_ranks == dp.tolist(), (kwargs, dp_ranks)
            assert dp_names[-1] == ("dp_shard_cp" if "cp" in names else "dp_shard")
            assert dp_group_size == dp.shape[-1]


def test_one_layout_builds_its_mesh_once():
    # [Note: one mesh per layout]: laying out a second model builds no new process groups.
    for built, rebuilt, same, other_is_new, dp_size in run_on_ranks(4, tp_workers.mesh_reuse):
        assert built > 0 and rebuilt == 0 and same and other_is_new
        assert dp_size == 2  # dp_replicate 2 x dp_shard 1


def test_loss_parallel_logits_need_the_context():
    for message in run_on_ranks(2, tp_workers.loss_outside_loss_parallel):
        assert message is not None and "inside torch.distributed.tensor.parallel.loss_parallel()" in message
