"""Faults: non-finite gradients named with their ranks; a collective timeout named."""

import pytest

from tests.harness import BACKEND, run_on_ranks
from tests.dist import fault_workers as fw


def test_check_finite_option_raises_on_every_rank():
    for message, _ in run_on_ranks(2, fw.nonfinite_named, True):
        assert "non-finite gradients in" in message and "on rank(s) 0, 1" in message
        assert "embed.weight" in message


def test_clip_grad_norm_reports_and_check_finite_names():
    for message, reported in run_on_ranks(2, fw.nonfinite_named, False):
        assert reported is True
        assert "non-finite gradients in" in message and "blocks.0.up.weight on rank(s) 0, 1" in message


def test_collective_timeout_names_step_unit_and_kind():
    if BACKEND == "nccl":
        pytest.skip("NCCL reports timeouts asynchronously, through its watchdog; this checks gloo's synchronous error")
    message = run_on_ranks(2, fw.collective_timeout)[0]
    assert message is not None and message != "no error"
    assert "all_gather for <root> failed at iteration" in message
