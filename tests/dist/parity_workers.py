"""Parity with a single process, run on every rank by tests/dist/test_parity.py (module-level so
workers import them): the engine trains as one process does, for every strategy, mesh and
precision, with a block used twice, frozen parameters, and the optimizer offloaded to the CPU."""

from __future__ import annotations

import copy

import torch

import fsdp8

from . import common
from .workers import CountCollectives


def parity(kind, strategy, outer="no_shard", mesh_shape=None, precision="fp32", steps=10, micro_batches=1,
           model_kw=None, reshard_after_forward=True):
    """Train sharded and single-process from the same init and data; return relative errors."""
    model = common.build(kind, **(model_kw or {}))
    reference = copy.deepcopy(model)
    prec = fsdp8.Precision() if precision == "fp32" else fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer,
                                precision=prec, reshard_after_forward=reshard_after_forward)
    common.train_sharded(sharded, steps, micro_batches=micro_batches)
    common.train_reference(reference, steps, compute_dtype=None if precision == "fp32" else torch.bfloat16,
                           micro_batches=micro_batches)
    return common.relative_errors(sharded, reference)


# -- special module structures ---------------------------------------------------------------
class TwiceModel(torch.nn.Module):
    """One block is used twice in a forward (weight sharing across depth)."""

    def __init__(self, vocab):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 17)
        self.blocks = torch.nn.ModuleList([common.UnevenBlock(), common.UnevenBlock()])
        self.head = torch.nn.Linear(17, vocab)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[0](x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def twice(strategy):
    torch.manual_seed(0)
    model = TwiceModel(common.vocab_of(None)).to(common.device())
    reference = copy.deepcopy(model)
    sharded = fsdp8.fully_shard(model, strategy=strategy)
    with CountCollectives() as counter:
        common.train_sharded(sharded, 4)
    common.train_reference(reference, 4)
    return common.relative_errors(sharded, reference), counter.counts


def frozen(strategy):
    """Frozen parameters (a whole embedding, and part of a unit) stay put and get no gradient."""
    model = common.build("uneven")
    model.embed.weight.requires_grad_(False)
    model.blocks[0].up.weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    sharded = fsdp8.fully_shard(model, strategy=strategy)
    common.train_sharded(sharded, 5)
    common.train_reference(reference, 5)
    sd = sharded.state_dict()
    frozen_err = max(float((sd[n].full_tensor() - v).abs().max()) for n, v in frozen_before.items())
    frozen_grads = [n for n, p in sharded.named_parameters() if not p.requires_grad and p.grad is not None]
    report = sharded.memory_report()
    trainable = sum(u.layout.trainable_numel for u in sharded._fsdp8.all_units)
    total = sum(u.layout.chunk_numel for u in sharded._fsdp8.all_units)
    return common.relative_errors(sharded, reference), frozen_err, frozen_grads, report.grads, trainable, total


# -- CPU offload -----------------------------------------------------------------------------------
def offload_parity(strategy, mesh_shape=None, outer="no_shard", micro_batches=1):
    """offload="optim" moves data, not arithmetic: on CPUs the offloaded run equals the same
    run without offload bit for bit (the host buffers are where the device ones would be, but
    every copy in and out of them still runs). On GPUs its optimizer steps run on the host,
    whose kernels round differently by an ulp; with SGD (linear in the gradients, no FP8 to
    flip bytes) the runs then stay within a few fp32 ulps: 1e-5 relative (the test's bound)."""
    runs = []
    for offload in ("optim", None):
        model = common.build("llama")
        sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer,
                                    offload=offload)
        opt = torch.optim.SGD(sharded.parameters(), lr=1e-2, momentum=0.9)
        common.train_sharded(sharded, 5, micro_batches=micro_batches, opt=opt)
        runs.append(sharded)
    offloaded, plain = runs
    report = offloaded.memory_report()
    units = offloaded._fsdp8.all_units
    placed = all(u.offload and u.main.device.type == "cpu" and not u.aliased for u in units)
    grads_on_host = all(p.grad is None or p.grad._local_tensor.device.type == "cpu" for p in offloaded.parameters())
    # Shard by shard: an offloaded shard lives in host memory, where NCCL cannot gather it.
    pairs = [(k, v.to_local().cpu(), plain.state_dict()[k].to_local().cpu()) for k, v in offloaded.state_dict().items()]
    differ = {k: float((a - b).norm() / b.norm().clamp_min(1e-12)) for k, a, b in pairs if not torch.equal(a, b)}
    plain_report = plain.memory_report()
    return (differ, report.offloaded, report.host, report.persistent, plain_report.main_weights + plain_report.grads,
            placed, grads_on_host)
