"""fsdp8's FP8 linears under torch's own FSDP, run on every rank by tests/dist/test_fp8_engine.py
(and the GPU tests): FSDP2 with 8-bit weight all-gathers (fsdp8.fp8.fsdp2), FSDP1 with
delayed-scaling histories made to agree, and standalone linears given an amax reduction group."""

from __future__ import annotations

import copy

import torch

from . import common


def fsdp2_fp8_interop(steps=4, precompute=True, kind="llama"):
    """A model converted by fsdp8 trains under torch FSDP2 with 8-bit weight all-gathers and
    matches the same FP8 recipe in one process. ``kind="uneven"`` converts every linear,
    including 17-wide and 3-row ones, so FSDP2 cuts uneven and empty shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.fp8.fsdp2 import Float8TrainingWeight, precompute_fp8_scales, use_fp8_all_gather
    from fsdp8.fp8.recipes import Float8CurrentScaling

    recipe = Float8CurrentScaling()
    model = common.build_fp8_llama() if kind == "llama" else common.build("uneven")
    blocks = model.layers if kind == "llama" else model.blocks
    for layer in blocks:
        convert_to_fp8(layer, recipe, filter=None if kind == "llama" else (lambda n, m: True))
    reference = copy.deepcopy(model)
    wrapped = use_fp8_all_gather(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in blocks:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    locals_ = [p._local_tensor for n, p in model.named_parameters() if ("layers" in n or "blocks" in n) and p.dim() == 2]
    sharded_ok = all(isinstance(t, Float8TrainingWeight) for t in locals_)
    calls = {"pre": 0}
    original = Float8TrainingWeight.fsdp_pre_all_gather

    def counting(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 checks this signature
        calls["pre"] += 1
        out = original(self, mesh, outer_size, outer_stride, module, mp_policy)
        calls["dtype"] = str(out[0][0].dtype)
        return out

    Float8TrainingWeight.fsdp_pre_all_gather = counting
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        w, r = common.world(), common.rank()
        losses = []
        for step in range(steps):
            if precompute:
                precompute_fp8_scales(model)
            x, y = common.global_batch(step, 2 * w, 8, common.vocab_of(model))
            loss = model(common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device()))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    finally:
        Float8TrainingWeight.fsdp_pre_all_gather = original
    common.train_reference(reference, steps, compute_dtype=torch.bfloat16)
    sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
    errors = {k: float((sd[k].float() - v.float()).norm() / v.float().norm()) for k, v in reference.state_dict().items()
              if k in sd}
    return {"wrapped": len(wrapped), "sharded_ok": sharded_ok, "pre_calls": calls["pre"], "dtype": calls.get("dtype"),
            "errors": errors, "losses": losses}


def fsdp1_delayed(prepare=True, steps=3):
    """torch FSDP1 around Float8Linears: prepare_fp8_modules_for_fsdp makes delayed-scaling
    histories agree across ranks (each rank sees different data)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.fp8.fsdp2 import prepare_fp8_modules_for_fsdp
    from fsdp8.fp8.linear import Float8Linear
    from fsdp8.fp8.recipes import DelayedScaling

    model = common.build_fp8_llama()
    convert_to_fp8(model, DelayedScaling(amax_history_len=4), filter=lambda n, m: n.startswith("layers"))
    wrapped = FullyShardedDataParallel(model, use_orig_params=True, device_id=common.device())
    count = prepare_fp8_modules_for_fsdp(wrapped) if prepare else 0
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    w, r = common.world(), common.rank()
    for step in range(steps):
        x, y = common.global_batch(step, 2 * w, 8, common.vocab_of(model))
        wrapped(common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device())).backward()
        opt.step()
        opt.zero_grad()
    histories = torch.stack([m._delayed.history for m in wrapped.modules() if isinstance(m, Float8Linear)])
    return count, histories.cpu()


def delayed_group_reduce(with_group=True, steps=3):
    """Standalone Float8Linears given an amax_reduction_group (what prepare_fp8_modules_for_fsdp
    sets) keep identical delayed-scaling histories although each rank sees other data."""
    import torch.distributed as dist

    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.fp8.linear import Float8Linear
    from fsdp8.fp8.recipes import DelayedScaling

    model = common.build_fp8_llama()
    convert_to_fp8(model, DelayedScaling(amax_history_len=4), filter=lambda n, m: n.startswith("layers"))
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.amax_reduction_group = dist.group.WORLD if with_group else None
    w, r = common.world(), common.rank()
    for step in range(steps):
        x, y = common.global_batch(step, 2 * w, 8, common.vocab_of(model))
        model(common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device())).backward()
    return torch.stack([m._delayed.history for m in model.modules() if isinstance(m, Float8Linear)]).cpu()
