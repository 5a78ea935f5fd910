"""Fault scenarios run on every rank by tests/dist/test_faults.py."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp8

from . import common


def nonfinite_named(use_engine_option: bool):
    """A NaN in rank 1's gradients: the error names the parameters and the rank, on every rank."""
    model = common.build("uneven")
    sharded = fsdp8.fully_shard(model, check_finite=use_engine_option)
    x, y = common.global_batch(0, 2 * common.world(), 8, common.vocab_of(sharded))
    w, r = common.world(), common.rank()
    loss = sharded(common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device()))
    if r == 1:
        loss = loss * float("nan")
    reported = None
    try:
        loss.backward()
        if not use_engine_option:
            reported = bool(torch.isnan(fsdp8.clip_grad_norm_(sharded, 1.0)))  # the norm shows it
            fsdp8.engine.check_finite(sharded)
    except fsdp8.engine.NonFiniteGradError as e:
        return str(e), reported
    return "no error", reported


def collective_timeout():
    """Rank 1 skips a forward: rank 0's all-gather times out with a message naming it."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    mesh = DeviceMesh.from_group(group, "cpu")
    sharded = fsdp8.fully_shard(common.build("uneven"), mesh=mesh)
    x, y = common.global_batch(0, 2, 8, common.vocab_of(sharded))
    if common.rank() == 1:
        return None
    try:
        sharded(x, y)
    except fsdp8.distributed.comm.CollectiveError as e:
        return str(e)
    return "no error"
