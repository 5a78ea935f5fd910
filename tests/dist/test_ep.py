"""Expert parallelism (ParallelConfig(ep=N)) against one process (gloo, 4 ranks): the built-in
MoE Llama and Hugging Face's Qwen3-MoE and Mixtral, every strategy, HSDP.

Tolerances, derived: the parallel run computes each token's experts on another rank, with
the same routing and the same fp32 operations, but its grouped GEMMs see other groupings of
rows and its gradients are summed in another order (the all-to-all's backward brings an
expert's contributions from every rank, then the engine averages over the rest). As in
test_parallelize.py, two fp32 runs with differently ordered sums stay within 4e-6 relative
on gradients and SGD weights, 1e-6 on the loss. The clipped norm is one more reduction of
those gradients: 4e-6.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import ep_workers as workers
from tests.harness import retire_pool, run_on_ranks

FP32_TOL = 4e-6
LOSS_TOL = 1e-6


def _check(results, ep: int, cp: int = 1, tp: int = 1):
    for out in results:
        errors = out["errors"]
        assert errors["loss"] <= LOSS_TOL and errors["grad"] <= FP32_TOL and errors["norm"] <= FP32_TOL, errors
        assert errors["weight"] <= FP32_TOL, errors
        # The experts are split over ep (their engine shards over efsdp are a level below).
        placed = out["experts"]
        assert placed and all(p.get("ep") == "S(0)" for p in placed.values()), placed
        assert all(any("efsdp" in dim for dim in p) for p in placed.values()), placed
        assert all(p.get("tp", "R") == "R" for p in placed.values()), placed  # every tp rank holds its ep group's
    group = cp * tp  # the ranks of one data-parallel rank
    assert [out["dp"] for out in results] == [(r // group, len(results) // group) for r in range(len(results))]


@pytest.mark.parametrize("family", ["builtin", "qwen3_moe", "mixtral"])
def test_ep2_parity(family):
    pytest.importorskip("transformers") if family != "builtin" else None
    _check(run_on_ranks(4, workers.parity, family, {"ep": 2}), 2)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_ep4_strategies(strategy):
    _check(run_on_ranks(4, workers.parity, "builtin", {"ep": 4, "strategy": strategy}), 4)


def test_ep4_hugging_face():
    pytest.importorskip("transformers")
    _check(run_on_ranks(4, workers.parity, "mixtral", {"ep": 4}), 4)


def test_ep_compiled():
    # Each decoder layer compiled: the experts unit's engine hooks and the dispatch (rows that
    # change in number every step) run outside the graph, so nothing recompiles per step.
    _check(run_on_ranks(4, workers.parity, "builtin", {"ep": 2, "compile": True}), 2)


def test_ep_with_context_parallelism():
    # dp_shard 2 x cp 2: the experts split over the two dp_shard ranks of each cp index.
    _check(run_on_ranks(4, workers.parity, "builtin_noaux", {"ep": 2, "cp": 2}), 2, cp=2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("family", ["builtin", "qwen3_moe"])
def test_ep2_with_tp2(family, sequence_parallel):
    # dp_shard 2 x tp 2: attention tensor-parallel, experts split over the two dp_shard ranks of
    # each tp index, the router replicated. With sequence parallelism each tp rank routes its half
    # of every sequence (expert and router gradients summed over tp); without, both route all of
    # it (their gradients must not be). Same bounds: fp32 with other summation orders.
    if family != "builtin":
        pytest.importorskip("transformers")
    layout = {"ep": 2, "tp": 2, "sequence_parallel": sequence_parallel}
    _check(run_on_ranks(4, workers.parity, family, layout), 2, tp=2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_ep2_with_tp2_compiled(sequence_parallel):
    # Each decoder layer compiled (aot_eager: Dynamo and AOTAutograd as inductor, without its C++
    # compilation on CPUs). The embedding's row-parallel output reaches the first compiled layer
    # as an AsyncCollectiveTensor, whose gradient AOTAutograd drops unless the engine waits on it
    # outside the graph (comm.py [Note: async-collective inputs]): the
    # embedding's gradient was zero. Nothing recompiles after the first step.
    # Fresh ranks: in processes that had run the uncompiled ep x tp tests (without, then with
    # sequence parallelism) AOTAutograd's partitioner failed on this graph ("Node tangents_2 was
    # invalid, but is output", the joint graph returning a tangent where a fresh process returns
    # an input; torch 2.13, like pytorch/torchtitan#3013 for DTensor outputs). Which state
    # carried over was not found (torch._dynamo.reset() does not clear it); a fresh process passes.
    retire_pool(4)
    layout = {"ep": 2, "tp": 2, "sequence_parallel": sequence_parallel, "compile": {"backend": "aot_eager"}}
    _check(run_on_ranks(4, workers.parity, "builtin", layout), 2, tp=2)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_ep_hsdp(outer):
    _check(run_on_ranks(4, workers.parity, "qwen3_moe", {"ep": 2, "dp_replicate": 2, "outer_strategy": outer}), 2)


@pytest.mark.parametrize("family,layout,expected", [
    ("builtin", {"ep": 3}, "ep=3 must divide dp_shard=4"),
    ("builtin", {"ep": 2, "dp_shard": 2, "dp_replicate": 2}, None),
    ("dense", {"ep": 2}, "has none"),
    ("builtin6", {"ep": 4}, "ep=4 does not divide the 6 experts"),
    ("builtin", {"ep": 4, "tp": 2}, "ep=4 must divide dp_shard=2 (the world of 4 ranks over tp=2 and the other "
                                    "dims): expert parallelism borrows its ranks from the data-parallel shard dim; "
                                    "choose ep among [1, 2], or change dp_shard or lower tp"),
    ("builtin", {"tp": 2}, "tp=2 with a mixture-of-experts model and ep=1: tensor parallelism splits attention"),
])
def test_bad_ep_raises_on_every_rank(family, layout, expected):
    results = run_on_ranks(4, workers.bad_config, family, layout)
    if expected is None:
        assert results == ["no error"] * 4
    else:
        assert len(set(results)) == 1 and expected in results[0], results


def test_checkpoint_across_ep_degrees(tmp_path):
    # ep 2 -> ep 4 -> dp 4 without ep -> HSDP 2 x 2 with ep 2: weights and AdamW moments come
    # back bit for bit at every hop (torch.distributed.checkpoint reshards the experts).
    hops = [{"ep": 2}, {"ep": 4, "strategy": "optim"}, {}, {"ep": 2, "dp_replicate": 2}]
    path_in, saved = None, None
    for i, layout in enumerate(hops):
        path_out = str(tmp_path / f"hop{i}")
        loaded, new_saved = run_on_ranks(4, workers.checkpoint_hop, "qwen3_moe", path_in, path_out, layout)[0]
        if saved is not None:
            assert set(loaded) == set(saved)
            assert [k for k in saved if not (loaded[k] == saved[k]).all()] == [], f"hop {i} {layout}"
        path_in, saved = path_out, new_saved


@pytest.mark.parametrize("family,layout", [("qwen3_moe", {"ep": 4}), ("mixtral", {"ep": 2, "dp_replicate": 2})])
def test_load_pretrained_reads_hugging_face_experts_into_their_ep_ranks(tmp_path, family, layout):
    # save_pretrained writes the experts one at a time, as the Hub's checkpoints hold them.
    pytest.importorskip("transformers")
    for worst in run_on_ranks(4, workers.load_pretrained_under_ep, family, str(tmp_path / "hf"), layout):
        assert any("experts" in name for name in worst) and max(worst.values()) == 0.0, worst


@pytest.mark.parametrize("family,ep", [("builtin", 2), ("qwen3_moe", 4)])
def test_fp8_dispatch_equals_one_process_on_rounded_rows(family, ep):
    # Bound: fp64 compute on both sides (common.FP8_PARITY_PRECISION), and each dispatched row is
    # rounded to FP8 on its own, so the ep run and one process whose experts take rows_through_fp8
    # of their input round the same values the same way; what is left is the router's fp32 softmax
    # (an ulp, 6e-8 relative, when its fp64 logits were summed in another order): 1e-6.
    if family != "builtin":
        pytest.importorskip("transformers")
    for out in run_on_ranks(4, workers.fp8_dispatch_parity, family, ep):
        assert max(out["errors"].values()) <= 1e-6, out["errors"]
        # hidden 32: 32 e4m3 bytes and one fp32 scale a row, against 32 x 8 bytes in fp64 compute
        assert out["sent"] == [("torch.uint8", 32 + 4)], out["sent"]


@pytest.mark.parametrize("family,layout", [("builtin", {"ep": 2}), ("qwen3_moe", {})])
def test_fp8_experts(family, layout):
    # Bound: fp64 compute around exact FP8 products (common.FP8_PARITY_PRECISION), but the
    # router's softmax runs in fp32 (as transformers'), so a routing weight may differ by an fp32
    # ulp (6e-8 relative) when its fp64 logits were summed in another order: 1e-6 on the loss
    # and the gradients it reaches. The experts' weight gradients are only checked to be close
    # (their token blocks follow the rows the ep group sent; e5m2 gradients make that percents).
    # transformers' experts (their own forward) run fsdp8's under an FP8 recipe, so they convert too.
    if family != "builtin":
        pytest.importorskip("transformers")
    for out in run_on_ranks(4, workers.fp8_block_parity, family, layout):
        assert len(out["experts"]) == 2 and out["converted"] == out["experts"], out
        assert out["loss"] <= 1e-6, out["loss"]
        experts = {n: e for n, e in out["grads"].items() if "experts" in n}
        others = {n: e for n, e in out["grads"].items() if "experts" not in n}
        assert max(others.values()) <= 1e-6, others
        assert max(experts.values()) <= (0.1 if layout.get("ep", 1) > 1 else 1e-6), experts


@pytest.mark.parametrize("family,layout", [("builtin", {"ep": 2}), ("qwen3_moe", {})])
def test_delayed_scaling_experts(family, layout):
    # Bound: as test_fp8_experts (fp64 compute around exact FP8 products, an fp32 router softmax):
    # 1e-6 on each step's loss and on the weights after three SGD steps. The histories hold amaxes
    # of those values: 1e-6 too. Every expert's history rows moved (scaled FP8, not scale 1).
    if family != "builtin":
        pytest.importorskip("transformers")
    for out in run_on_ranks(4, workers.delayed_parity, family, layout):
        assert out["experts"] == 4 and out["moved"], out  # 2 layers x (gate_up_proj, down_proj)
        assert max(out["losses"]) <= 1e-6, out["losses"]
        assert max(out["weights"].values()) <= 1e-6, {n: e for n, e in out["weights"].items() if e > 1e-6}
        assert max(out["histories"]) <= 1e-6 and max(out["scales"]) <= 1e-6, (out["histories"], out["scales"])


def test_delayed_experts_histories_load_at_another_ep_degree(tmp_path):
    # Every rank holds every expert's history, so ep 2 -> ep 4 -> dp 4 moves them bit for bit.
    for i, (save, load) in enumerate([({"ep": 2}, {"ep": 4}), ({"ep": 4}, {})]):
        out = run_on_ranks(4, workers.delayed_checkpoint_hop, str(tmp_path / f"hop{i}"), save, load)[0]
        assert out["moved"] and out["inverses"] and len(out["saved"]) == 4, out["moved"]
        for (h, s), (h2, s2) in zip(out["saved"], out["loaded"]):
            assert torch.equal(h, h2) and torch.equal(s, s2)


@pytest.mark.parametrize("recipe", ["bf16", "fp8-current", "fp8-block"])
def test_one_host_read_per_moe_layer(recipe):
    # The split sizes and the FP8 GEMMs' group bounds come from one read of the counts.
    for reads in run_on_ranks(2, workers.host_reads_per_moe_layer, recipe):
        assert reads == 1, reads


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_router_under_tp_computes_on_plain_tensors(sequence_parallel):
    # ExpertParallelBlock over tp 2: the router's top-k never sees a DTensor (torch 2.11's topk
    # backward fails on one: "aten.scatter.src got mixed torch.Tensor and DTensor"), its weight's
    # gradient is Partial over tp when the tp ranks routed different tokens, a deep copy's router
    # reads the copy's parameters, and the block's output, load-balancing loss and gradients are
    # one process's (fp32, other summation orders).
    for out in run_on_ranks(2, workers.router_on_plain_tensors, sequence_parallel):
        assert out["topk_calls"] >= 1 and out["topk_on_dtensor"] == 0, out  # the router was watched
        assert out["router_grad"] == (["Partial"] if sequence_parallel else ["Replicate"]), out
        assert out["copy_uses_its_own"], out
        assert out["out"] <= FP32_TOL and out["aux"] <= LOSS_TOL, out
        assert max(out["grads"].values()) <= FP32_TOL, out
