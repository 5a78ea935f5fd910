"""The test pool itself (tests/harness.py): how a task's result comes back."""

import time

import pytest

from tests.harness import RankFailure, run_on_ranks


def unpicklable_result():
    return {"fine": 1, "not": lambda: None}  # a lambda cannot be pickled


def test_a_result_that_cannot_travel_back_fails_at_once():
    # The queue pickled results in a thread of its own: the failure was printed, the result lost,
    # and the test waited out its timeout (240 s) for a rank that had long answered.
    start = time.time()
    with pytest.raises(RankFailure, match="cannot be sent back") as failure:
        run_on_ranks(1, unpicklable_result, timeout=60)
    assert time.time() - start < 30, failure.value
    assert run_on_ranks(1, dict, timeout=60) == [{}]  # the next task runs on a fresh pool as usual
