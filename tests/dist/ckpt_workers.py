"""Checkpoint scenarios run on every rank by tests/dist/test_checkpoint.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import fsdp8

from . import common

GLOBAL_BATCH = 4  # sequences per step over all ranks, so runs at different world sizes see the same data
VOCAB = 17  # fixed, so the model is the same at every world size


def _build(strategy, mesh_shape, outer, seed=0):
    model = common.build("llama", seed=seed, vocab=VOCAB)
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, weight_decay=0.1)
    return sharded, opt


def _train(model, opt, first_step, steps):
    w, r = common.world(), common.rank()
    for step in range(first_step, first_step + steps):
        x, y = common.global_batch(step, GLOBAL_BATCH, 8, common.vocab_of(model))
        model(common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device())).backward()
        fsdp8.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _snapshot(model, opt):
    params = {k: _full(v) for k, v in model.state_dict().items()}
    moments = {n: _full(opt.state[p]["exp_avg"]) for n, p in model.named_parameters() if p in opt.state}
    return params, moments


def save_after(path, strategy, mesh_shape=None, outer="no_shard", steps=2):
    model, opt = _build(strategy, mesh_shape, outer)
    _train(model, opt, 0, steps)
    fsdp8.save(path, model, opt, extra={"step": steps, "rank": common.rank(), "rng": torch.get_rng_state()})
    return _snapshot(model, opt)


def load_and_continue(path, strategy, mesh_shape=None, outer="no_shard", steps_before=2, steps_after=2):
    model, opt = _build(strategy, mesh_shape, outer, seed=123)  # different init: all must come from the file
    extra = fsdp8.load(path, model, opt)
    loaded = _snapshot(model, opt)
    _train(model, opt, steps_before, steps_after)
    return loaded, {k: _full(v) for k, v in model.state_dict().items()}, extra["step"], extra["rank"]


def reference(steps):
    """Single-process training with the same data and recipe."""
    model = common.build("llama", vocab=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        x, y = common.global_batch(step, GLOBAL_BATCH, 8, common.vocab_of(model))
        model(x.to(common.device()), y.to(common.device())).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def load_into_plain(path):
    """A checkpoint written by fsdp8 loads into an unsharded model with DCP alone."""
    import torch.distributed.checkpoint as dcp

    plain = common.build("llama", seed=7, vocab=VOCAB)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path)
    return {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}


def fsdp2_roundtrip(path_from_fsdp2, path_from_fsdp8):
    """torch FSDP2 writes a DCP checkpoint that fsdp8 loads, and the other way round."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    torch_model = common.build("llama", vocab=VOCAB)
    for layer in torch_model.layers:
        fully_shard(layer)
    fully_shard(torch_model)
    opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-3)
    _train(torch_model, opt, 0, 2)
    dcp.save({"model": get_model_state_dict(torch_model), "optim": get_optimizer_state_dict(torch_model, opt)},
             checkpoint_id=path_from_fsdp2)
    torch_state = {k: _full(v) for k, v in get_model_state_dict(torch_model).items()}

    ours, our_opt = _build("optim_grads_params", None, "no_shard", seed=9)
    fsdp8.load(path_from_fsdp2, ours, our_opt)
    into_fsdp8 = max(float((_full(v) - torch_state[k]).abs().max()) for k, v in ours.state_dict().items())
    _train(ours, our_opt, 2, 1)
    fsdp8.save(path_from_fsdp8, ours, our_opt)
    saved = {k: _full(v) for k, v in ours.state_dict().items()}

    back = common.build("llama", seed=5, vocab=VOCAB)
    for layer in back.layers:
        fully_shard(layer)
    fully_shard(back)
    state = {"model": get_model_state_dict(back)}
    dcp.load(state, checkpoint_id=path_from_fsdp8)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(back, state["model"])
    into_fsdp2 = max(float((_full(v) - saved[k]).abs().max()) for k, v in get_model_state_dict(back).items())
    return into_fsdp8, into_fsdp2


def fp8_roundtrip(path, recipe_name):
    """FP8 primary weights and their scales, and delayed-scaling histories, come back bit for bit."""
    from fsdp8.fp8.convert import fp8_init
    from fsdp8.fp8.recipes import recipe_from_name
    from fsdp8.models.llama import Llama

    recipe = recipe_from_name(recipe_name)
    cfg = common.build_fp8_llama().config
    prec = fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build(seed):
        torch.manual_seed(seed)
        with torch.device("meta"), fp8_init(recipe):
            model = Llama(cfg)
        torch.manual_seed(seed)
        model = fsdp8.fully_shard(model, precision=prec)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def fp8_state(model):
        histories = {n: b.cpu().clone() for n, b in model.named_buffers() if "fp8_" in n}
        model._fsdp8.scales.refresh()  # what the next forward does first
        out = {}
        for unit in model._fsdp8.all_units:
            if not hasattr(unit, "fp8_ids"):
                continue
            unit.gather()
            unit.wait_gather()
            for slot in unit.slots:
                if id(slot) in unit.fp8_ids:
                    q = slot.compute.quantized()
                    out[slot.fqn] = (q.data.view(torch.uint8).cpu().clone(), q.scale_inv.cpu().clone())
            unit.reshard()
        return out, histories

    model, opt = build(0)
    common.train_sharded(model, 3)
    fsdp8.save(path, model, opt)
    before, hist_before = fp8_state(model)
    other, other_opt = build(1)
    fsdp8.load(path, other, other_opt)
    after, hist_after = fp8_state(other)
    same_bytes = all(torch.equal(before[k][0], after[k][0]) and torch.equal(before[k][1], after[k][1]) for k in before)
    same_hist = all(torch.equal(hist_before[k], hist_after[k]) for k in hist_before)
    return len(before), same_bytes, len(hist_before), same_hist


def remove_file_then_load(path):
    """A data file deleted from a checkpoint: the same named error on every rank, no hang."""
    model, opt = _build("optim_grads_params", None, "no_shard")
    fsdp8.save(path, model, opt)
    dist.barrier()
    if common.rank() == 0:
        victim = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
        os.remove(os.path.join(path, victim))
    dist.barrier()
    try:
        fsdp8.load(path, model, opt)
    except fsdp8.checkpoint.CheckpointError as e:
        return str(e)
    return None


def flip_then_load(path):
    """One flipped byte in an item only rank 1 reads back (its own rows of a weight): the
    checksum error on rank 1 reaches every rank as one CheckpointError, no hang."""
    from fsdp8.checkpoint.safe_io import read_metadata_safely

    model, opt = _build("optim_grads_params", None, "no_shard")
    fsdp8.save(path, model, opt)
    dist.barrier()
    if common.rank() == 0:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = read_metadata_safely(f)
        item = next(v for k, v in metadata.storage_data.items()
                    if k.fqn == "model.embed.weight" and v.relative_path.startswith("__1_"))
        with open(os.path.join(path, item.relative_path), "r+b") as f:
            f.seek(item.offset + item.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()
    try:
        fsdp8.load(path, model, opt)
    except fsdp8.checkpoint.CheckpointError as e:
        return str(e)
    return None


def save_unstorable_extra(path):
    """Rank 1's extra holds a set (not JSON): it raises TypeError and rank 0 says that another
    rank failed, instead of waiting for it inside the save's collectives."""
    model, opt = _build("optim", None, "no_shard")
    try:
        fsdp8.save(path, model, opt, extra={"ids": {1, 2}} if common.rank() == 1 else {})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def load_wrong_model(path):
    model, opt = _build("optim_grads_params", None, "no_shard")
    fsdp8.save(path, model, opt)
    other = fsdp8.fully_shard(common.build("uneven"))
    try:
        fsdp8.load(path, other)
    except fsdp8.engine.StateDictError as e:
        return str(e)
    return None


def rotation(directory, count=4, keep=2):
    model, opt = _build("optim", None, "no_shard")
    for step in range(count):
        _train(model, opt, step, 1)
        fsdp8.save(os.path.join(directory, f"step-{step}"), model, opt, keep_last=keep)
    return sorted(os.listdir(directory)), fsdp8.checkpoint.latest(directory)


def async_save(path_a, path_b):
    """Training goes on while a save is written; what lands is the state at the call."""
    model, opt = _build("optim_grads_params", None, "no_shard")
    _train(model, opt, 0, 1)
    at_save = {k: _full(v) for k, v in model.state_dict().items()}
    future = fsdp8.save(path_a, model, opt, async_save=True)
    _train(model, opt, 1, 2)  # changes weights while the files are written
    fsdp8.save(path_b, model, opt, async_save=True)  # max_in_flight=1: waits for the first
    first_done = future.done()
    fsdp8.checkpoint.wait_for_saves()
    fresh, fresh_opt = _build("optim_grads_params", None, "no_shard", seed=3)
    fsdp8.load(path_a, fresh, fresh_opt)
    err = max(float((_full(v) - at_save[k]).abs().max()) for k, v in fresh.state_dict().items())
    return first_done, err, fsdp8.checkpoint.store.is_complete(path_b)


def export_then_load_pretrained(ckpt, out):
    """fsdp8 export writes full weights; load_pretrained fills a fresh meta-built sharded model
    from them, each rank reading its rows: the two models are equal."""
    from fsdp8.checkpoint import export, load_pretrained
    from fsdp8.models.llama import Llama

    model, opt = _build("optim_grads_params", None, "no_shard")
    _train(model, opt, 0, 2)
    fsdp8.save(ckpt, model, opt)
    dist.barrier()
    if common.rank() == 0:
        export(ckpt, out)
    dist.barrier()
    torch.manual_seed(11)
    with torch.device("meta"):
        fresh = Llama(model.config)
    fresh = fsdp8.fully_shard(fresh, strategy="optim")  # another strategy, too
    read = []
    from fsdp8.checkpoint import safetensors as st

    original = st.SafetensorsFile.read

    def counting(self, name, region=None):
        value = original(self, name, region)
        read.append(value.numel())
        return value

    st.SafetensorsFile.read = counting
    try:
        load_pretrained(fresh, out)
    finally:
        st.SafetensorsFile.read = original
    err = max(float((_full(v) - _full(model.state_dict()[k])).abs().max()) for k, v in fresh.state_dict().items())
    # What this rank keeps: its rows of every parameter (and the buffers, whole).
    kept = sum(u.main_view(slot).numel() for u in fresh._fsdp8.all_units for slot in u.slots)
    kept += sum(b.numel() for n, b in fresh.named_buffers() if n in fresh.state_dict())
    return err, sum(read), kept, sum(_full(v).numel() for v in fresh.state_dict().values())
