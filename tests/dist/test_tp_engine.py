"""Tensor parallelism inside the engine: TP x data-parallel training equals one process.

Tolerances: fp32 as in test_parity.py (1e-6 relative): the TP run splits each GEMM's
reduction over tp ranks and sums the pieces (one more reordering of fp32 sums per layer),
which keeps gradient differences at the 1e-7 level that AdamW's normalisation does not
amplify over a few steps.
"""

from __future__ import annotations

import pytest

from tests.harness import run_on_ranks
from tests.dist import tp_engine_workers as workers

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
