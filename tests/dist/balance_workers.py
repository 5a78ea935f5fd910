"""Global-batch load balancing on every rank: functions run by tests/dist/test_load_balancing.py.

The built-in MoE Llama parallelized with ``ParallelConfig(load_balancing=...)`` against one
process fed the whole global batch in one forward: with "global" the ranks' router losses,
averaged as data-parallel gradients are, are that process's (each rank's own router
probabilities against the global batch's expert counts), so gradients and weights match; with
"local" each rank counts only its own rows, which the comparison must tell apart.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import fsdp8

from .ep_workers import FP32, LR, ROWS_PER_RANK, STEPS, batch, build
from .parallelize_workers import fold_step_errors, fold_weight_errors, loss_of

AUX_COEF = 1.0  # large, so that the router loss moves the router's gradient visibly


def _global_reference(model, dp: int) -> dict:
    """One process, one forward per step on the whole global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = {"loss": [], "grads": []}
    for step in range(STEPS):
        loss = loss_of(model, batch("builtin", step, ROWS_PER_RANK * dp))
        loss.backward()
        out["loss"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def global_batch_parity(load_balancing: str, layout: dict) -> dict:
    """Worst relative errors of loss, gradients and final weights (SGD with momentum) of the
    parallelized model against the one-process global-batch reference."""
    initial = build("builtin")
    initial.config = dataclasses.replace(initial.config, router_aux_loss_coef=AUX_COEF)
    model = fsdp8.parallelize(copy.deepcopy(initial),
                              fsdp8.ParallelConfig(**layout, load_balancing=load_balancing, precision=FP32))
    reference = _global_reference(initial, model.dp_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    for step in range(STEPS):
        loss = loss_of(model, model.shard_batch(batch("builtin", step, ROWS_PER_RANK * model.dp_size)))
        loss.backward()
        fold_step_errors(worst, model, loss, reference, step)
        opt.step()
        opt.zero_grad()
    fold_weight_errors(worst, model, reference)
    return worst


def refused(family: str) -> str:
    """What parallelize says to load_balancing='global' for ``family`` (before any collective)."""
    from .ep_workers import build as build_family

    try:
        fsdp8.parallelize(build_family(family), fsdp8.ParallelConfig(load_balancing="global", precision=FP32))
    except ValueError as e:
        return str(e)
    return "no error"
