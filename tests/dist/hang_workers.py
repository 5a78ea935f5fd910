"""Hang scenarios run on every rank by tests/dist/test_hang.py."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import fsdp8
from fsdp8.distributed import watchdog
from fsdp8.distributed.comm import CollectiveError

from . import common


def forward_on_some_ranks(deadline_s: float, forwarding: int):
    """A training step on every rank, then a forward on ranks below ``forwarding`` alone
    (a generate() there)."""
    os.environ[watchdog.TIMEOUT_ENV] = str(deadline_s)
    try:
        _step_then_forward_on_some_ranks(forwarding)
    finally:
        del os.environ[watchdog.TIMEOUT_ENV]


def stalled_messages_with_staggered_deadlines(deadline_s: float, forwarding: int, stagger_s: float):
    """As forward_on_some_ranks, with rank r's deadline ``deadline_s + r * stagger_s``: each
    forwarding rank returns its error message (None where no error), so the test sees the
    later ranks' view too, after the earlier ones have given up."""
    os.environ[watchdog.TIMEOUT_ENV] = str(deadline_s + common.rank() * stagger_s)
    try:
        _step_then_forward_on_some_ranks(forwarding)
        return None
    except CollectiveError as e:
        return str(e)
    finally:
        del os.environ[watchdog.TIMEOUT_ENV]


def _step_then_forward_on_some_ranks(forwarding: int):
    sharded = fsdp8.fully_shard(common.build("llama"))
    x, y = common.global_batch(0, 2, 8, common.vocab_of(sharded))
    sharded(x, y).backward()
    if common.rank() < forwarding:
        with torch.no_grad():
            sharded(x)


class _SlowWork:
    """A collective's work that completes ``seconds`` from now (a slow but matched collective)."""

    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def is_completed(self) -> bool:
        return time.time() >= self.end

    def wait(self, timeout=None) -> bool:
        left = self.end - time.time()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(left, 0.0))
        return True


def slow_collective_everyone_waiting(deadline_s: float, takes_s: float) -> float:
    """Every rank waits past the deadline in a collective that then completes: no error."""
    os.environ[watchdog.TIMEOUT_ENV] = str(deadline_s)
    try:
        dist.barrier()
        start = time.time()
        watchdog.wait(_SlowWork(takes_s), dist.group.WORLD, "all_gather for slow at iteration 0")
        return time.time() - start
    finally:
        del os.environ[watchdog.TIMEOUT_ENV]


def rank_sum():
    t = torch.tensor([float(common.rank())])
    dist.all_reduce(t)
    return float(t)
