"""GPU checks (NCCL, streams): run on the lent GPU machine with FSDP8_TEST_BACKEND=nccl."""

import os

import pytest
import torch

from tests.harness import run_on_ranks
from tests.gpu import workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("FSDP8_TEST_BACKEND") != "nccl",
                       reason="needs CUDA GPUs and FSDP8_TEST_BACKEND=nccl"),
]


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_training_step_has_no_host_sync(strategy):
    assert all(run_on_ranks(2, workers.sync_free_step, strategy))


def test_prepare_fp8_modules_for_fsdp1():
    """torch FSDP1 needs CUDA: with the wrapper's group, delayed histories agree across ranks."""
    (count, first), (_, second) = run_on_ranks(2, workers.fsdp1_delayed_histories)
    assert count == 14 and torch.isfinite(first).all(), first
    assert torch.equal(first, second)
