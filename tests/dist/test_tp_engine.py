"""Tensor parallelism inside the engine: TP x data-parallel training equals one process.

Tolerances: fp32 as in test_parity.py (1e-6 relative): the TP run splits each GEMM's
reduction over tp ranks and sums the pieces (one more reordering of fp32 sums per layer),
which keeps gradient differences at the 1e-7 level that AdamW's normalisation does not
amplify over a few steps.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_on_ranks
from tests.dist import tp_engine_workers as workers
from tests.dist import tp_fp8_workers

FP32_TOL = 1e-6
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _check(results, tol=FP32_TOL, init_tol=0.0):
    for out in results:
        worst = max(out["errors"].values())
        assert worst <= tol, {k: v for k, v in out["errors"].items() if v > tol}
        assert max(out["init"].values()) <= init_tol, out["init"]
        for ours, theirs in zip(out["norms"], out["ref_norms"]):
            assert abs(ours - theirs) <= 1e-5 * theirs, (out["norms"], out["ref_norms"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp2_tp2_parity(strategy):
    _check(run_on_ranks(4, workers.parity, strategy))


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_sequence_parallel_parity(strategy):
    # Norm weights see only their sequence shard: their partial gradients are summed over tp.
    _check(run_on_ranks(4, workers.parity, strategy, (2, 2), "no_shard", True))


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_hsdp_tp_parity(strategy, outer):
    # dp_replicate 2 x dp_shard 1 x tp 2 (world 4)
    _check(run_on_ranks(4, workers.parity, strategy, (2, 1, 2), outer))


def test_tp4_parity():
    _check(run_on_ranks(4, workers.parity, "optim_grads_params", (1, 4), "no_shard", True))


def test_tied_meta_init_no_sync():
    # Meta init under TP draws the unsharded model's values (init error exactly 0); the tied
    # embedding and head stay one parameter; gradient accumulation over 3 micro-batches.
    results = run_on_ranks(4, workers.parity, "optim_grads_params", (2, 2), "no_shard", False, 3, 3, True, None, True)
    _check(results)
    assert all(out["tied"] for out in results)


def _equal(a, b, keys=None):
    keys = keys or b.keys()
    return [k for k in keys if not torch.equal(a[k], b[k])]


def test_checkpoint_across_tp_layouts(tmp_path):
    # (dp 2, tp 2) -> (dp 4, tp 1) -> (dp 1, tp 4) -> HSDP (2, 1, 2) -> one process with DCP alone.
    # Weights and AdamW moments come back bit for bit at every hop, and training continues as
    # one uninterrupted single-process run would (fp32 bound of test_parity.py).
    hops = [(1, 2, 2), (1, 4, 1), (1, 1, 4), (2, 1, 2)]
    path_in, saved = None, None
    for i, layout in enumerate(hops):
        path_out = str(tmp_path / f"hop{i}")
        loaded, new_saved = run_on_ranks(4, workers.checkpoint_hop, path_in, path_out, layout, 18, 2, 0)[0]
        if saved is not None:
            assert set(loaded) == set(saved)
            assert _equal(loaded, saved) == [], f"hop {i} {layout}"
        path_in, saved = path_out, new_saved
    plain = run_on_ranks(1, workers.load_plain, path_in)[0]
    assert _equal(plain, saved, plain.keys()) == []
    reference = run_on_ranks(1, workers.checkpoint_reference, 2 * len(hops))[0]
    worst = max(float((saved[k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in reference.items())
    assert worst <= FP32_TOL


def test_fsdp2_tp_checkpoint_interop(tmp_path):
    saved, into_fsdp8, into_fsdp2 = run_on_ranks(4, workers.fsdp2_tp_interop, str(tmp_path / "a"), str(tmp_path / "b"))[0]
    assert set(into_fsdp8) == set(saved) and _equal(into_fsdp8, saved) == []
    assert set(into_fsdp2) == set(saved) and _equal(into_fsdp2, saved) == []


# FP8 with TP against the same recipe in one process, fp64 compute (common.FP8_PARITY_PRECISION),
# in lockstep. With the per-tensor scales of sharded operands agreed over tp (and blocks kept
# whole on each rank), every FP8 byte and scale equals the single process's; what differs is
# the order of the GEMM reductions split over tp and of the gradient sums, in fp64 around
# exact FP8 products; 1e-5 bounds the fp32 rounding of the main weights and optimizer steps
# (measured under 1e-7).
FP8_TOL = 1e-5


@pytest.mark.parametrize("recipe,sp,dims,compiled,replicated", [
    ("fp8-current", False, (32, 64), False, False),
    ("fp8-current", True, (32, 64), False, False),
    ("fp8-block", False, (256, 256), False, False),
    ("fp8-mxfp8", False, (64, 64), False, False),
    # Compiled blocks (fully_shard, then each block's forward compiled by hand, as the README
    # shows) trace the FP8 linears whole (fullgraph: a graph break fails the test). Without the
    # engine waiting on the first block's asynchronous-collective input, the norms' biases got
    # gradients 4e-3 off (comm.py [Note: async-collective inputs]).
    ("fp8-current", True, (32, 64), True, False),
    ("fp8-current", False, (32, 64), True, False),
    ("fp8-block", True, (256, 256), True, False),
    # Linears whole on every rank (ReplicateParallel): each rank's input gradient is the whole
    # one, not a partial sum, eager and compiled.
    ("fp8-current", False, (32, 64), False, True),
    ("fp8-current", False, (32, 64), True, True),
])
def test_fp8_tp_parity(recipe, sp, dims, compiled, replicated):
    for worst, converted in run_on_ranks(4, tp_fp8_workers.fp8_parity, recipe, (1, 2, 2), sp, 3, *dims,
                                         "optim_grads_params", compiled, replicated):
        assert converted == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
        assert max(worst.values()) <= FP8_TOL, {k: v for k, v in worst.items() if v > FP8_TOL}


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-current"])
def test_fp8_tp_equals_data_parallel(recipe):
    # Delayed scaling's histories (module buffers, compared too) take the tp-reduced amaxes.
    for worst in run_on_ranks(2, tp_fp8_workers.fp8_tp_vs_data_parallel, recipe):
        assert max(worst.values()) <= FP8_TOL, {k: v for k, v in worst.items() if v > FP8_TOL}


def test_fp8_sequence_parallel_gathers_fp8_bytes():
    # Each colwise FP8 layer (two blocks' up) gathers its sequence-sharded input as 1-byte
    # values; with bf16 compute the same gathers move 2 bytes per value through DTensor.
    # (The head stays bf16: vocab 32 over tp 2 is a 16-row piece, FP8-friendly, but it is
    # outside the units, which fully_shard does not convert.)
    tokens_per_rank, dim = 2 * 8 // 2, 32
    fp8 = run_on_ranks(2, tp_fp8_workers.fp8_sequence_parallel_bytes, "fp8-current")[0]
    fp8_inputs = [g for g in fp8 if g[0] == "fp8 input"]
    assert fp8_inputs == [("fp8 input", "torch.uint8", tokens_per_rank * dim)] * 2, fp8
    bf16 = run_on_ranks(2, tp_fp8_workers.fp8_sequence_parallel_bytes, "bf16")[0]
    # Without FP8 the same inputs travel through DTensor's gathers in the compute dtype (fp32 here).
    hp_inputs = [g for g in bf16 if g == ("dtensor", "torch.float32", tokens_per_rank * dim * 4)]
    fp8_hp_inputs = [g for g in fp8 if g == ("dtensor", "torch.float32", tokens_per_rank * dim * 4)]
    assert len(fp8_hp_inputs) == len(hp_inputs) - 2, (fp8, bf16)


@pytest.mark.parametrize("family,sequence_parallel", [("builtin", True), ("builtin", False), ("hf", True)])
def test_compiled_fp8_tp_moves_the_activations_bf16_moves(family, sequence_parallel):
    # FP8 adds scalar scale agreements to TP and nothing else: the activation-sized collectives
    # of a compiled step (q/k/v's and gate/up's input gradients summed once per input, under
    # sequence parallelism one reduce-scatter each) are bf16's, op for op and shape for shape.
    # A colwise FP8 linear that redistributed its already replicated input had every linear
    # all-reduce its own whole input gradient (five per layer here, instead of two reduce-scatters).
    # Each collective is waited for once (the scale agreements had a second wait of their own).
    fp8, collectives, waits = run_on_ranks(2, tp_fp8_workers.tp_compiled_collectives, "fp8-current",
                                           sequence_parallel, family)[0]
    bf16 = run_on_ranks(2, tp_fp8_workers.tp_compiled_collectives, "bf16", sequence_parallel, family)[0][0]
    assert bf16 and fp8 == bf16, (fp8, bf16)
    assert collectives > len(fp8) and waits == collectives, (collectives, waits)
    if sequence_parallel:
        # The layer's two sequence-sharded inputs (attention's, the MLP's) are each gathered once in
        # forward and their gradient reduce-scattered once in backward; the two row-parallel outputs
        # are reduce-scattered in forward and their gradients gathered in backward: 4 of each. Hugging
        # Face's plan gathered per projection (q/k/v, gate/up: 7 of each) until its attention and MLP
        # gathered once (GatherSequenceOnce); the built-in plan does it with torch's PrepareModuleInput.
        ops = [op for op, _ in fp8]
        assert ops.count("all_gather_into_tensor") == ops.count("reduce_scatter_tensor") == 4, fp8


def test_memory_report_per_rank():
    for got, expected in run_on_ranks(4, workers.memory_per_rank):
        assert got == expected


def test_bad_tp_inputs_raise_on_every_rank():
    for messages in run_on_ranks(4, workers.bad_tp_inputs):
        covers, unplaced, two_meshes = messages
        assert "x the tensor-parallel mesh's 2, but the world has 4" in covers
        assert "no parameter of the model is a tensor-parallel DTensor" in unplaced
        assert "are DTensors on different meshes" in two_meshes


def test_fp8_primary_weights_with_tp():
    # Both runs quantize the same weights with the same agreed scales: equal up to the fp32
    # order of gradient sums, the FP8_TOL of the lockstep tests without needing lockstep
    # (3 steps are too few for an order difference to flip a byte and diverge).
    for errors, primary in run_on_ranks(4, tp_fp8_workers.fp8_primary_tp):
        assert all(p for p in primary if p is not None) and any(primary), primary
        assert max(errors.values()) <= FP8_TOL, {k: v for k, v in errors.items() if v > FP8_TOL}


def test_delayed_fp8_checkpoint_across_tp_layouts(tmp_path):
    # Delayed scaling under TP: amax histories, scales and pending amaxes (module buffers,
    # agreed over dp x tp before saving) and weights and moments come back bit for bit at
    # (dp 2, tp 2) -> (dp 4) -> (dp 1, tp 4).
    path_in, saved = None, None
    for i, layout in enumerate([(1, 2, 2), (1, 4, 1), (1, 1, 4)]):
        path_out = str(tmp_path / f"hop{i}")
        loaded, new_saved = run_on_ranks(4, workers.checkpoint_hop, path_in, path_out, layout, 32, 2, 0,
                                         "fp8-delayed")[0]
        if saved is not None:
            assert set(loaded) == set(saved) and _equal(loaded, saved) == [], f"hop {i} {layout}"
        assert any("fp8_amax_history" in k for k in new_saved)
        path_in, saved = path_out, new_saved
