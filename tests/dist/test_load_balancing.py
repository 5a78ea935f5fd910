"""Global-batch load balancing of the router loss (ParallelConfig(load_balancing="global"))."""

from __future__ import annotations

import pytest

from tests.dist import balance_workers as workers
from tests.harness import run_on_ranks

# fp32 throughout: the one-process reference and the ranks sum the same numbers in other orders.
TOL = 4e-6


@pytest.mark.parametrize("layout", [{}, {"ep": 2}, {"compile": {"backend": "aot_eager"}}],
                         ids=["dp2", "dp2-ep2", "dp2-compiled"])
def test_global_balancing_equals_one_process_on_the_global_batch(layout):
    for worst in run_on_ranks(2, workers.global_batch_parity, "global", layout):
        assert max(worst.values()) <= TOL, worst


def test_global_balancing_with_ep_and_sequence_parallel_tp():
    # World 4 = dp_shard 2 x tp 2, ep 2: the router's probabilities are gathered over tp, the
    # expert counts summed over dp_shard only (tp ranks hold the same sequences).
    for worst in run_on_ranks(4, workers.global_batch_parity, "global",
                              {"ep": 2, "tp": 2, "sequence_parallel": True}):
        assert max(worst.values()) <= TOL, worst


def test_local_balancing_differs_from_the_global_batch():
    # The comparison above can fail: each rank counting its own rows is another loss.
    for worst in run_on_ranks(2, workers.global_batch_parity, "local", {}):
        assert worst["grad"] > 100 * TOL, worst


@pytest.mark.parametrize("family,message", [
    ("dense", "this built-in Llama is dense (num_experts=0); leave load_balancing='local'"),
    ("qwen3_moe", "transformers' MoE models compute theirs in their own forward); use load_balancing='local'"),
])
def test_global_balancing_refused_where_it_cannot_apply(family, message):
    if family == "qwen3_moe":
        pytest.importorskip("transformers")
    for got in run_on_ranks(2, workers.refused, family):
        assert message in got, got
