"""save / load: model and optimizer as DTensors through torch.distributed.checkpoint.

Checkpoints reshard on load (another world size, strategy or mesh) because every value is
a DTensor with its global shape: DCP matches the saved chunks to the new ones.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from ..distributed.check import check_same_everywhere
from ..distributed.process_group import current_device, init_distributed
from ..engine.state_dict import StateDictError, describe_mismatch
from ..fp8.grouped_delayed import all_delayed_experts
from . import checksums, extra as extra_values, store
from .reader import SafeLoadPlanner, SafeReader, same_kind
from .verify import Inspection, examine
from .writer import SafeWriter

_PENDING: List[Future] = []
_CKPT_GROUP = None


def _barrier(group=None) -> None:
    if dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def _agree_delayed_pending(model: nn.Module) -> None:
    """Delayed-scaling amaxes collected since the last update differ per rank until the next
    update reduces them (max); reduce them now, so the checkpoint holds one value for all."""
    states = [m._delayed for m in model.modules() if getattr(m, "_delayed", None) is not None]
    if states and dist.get_world_size() > 1:
        stacked = torch.stack([s.pending for s in states])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        for state, row in zip(states, stacked):
            state.pending.copy_(row)


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    state: Dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def _stage_to_host(obj: Any) -> Any:
    """An independent host copy of a (nested) state dict; DTensors keep their placement.

    GPU tensors go to page-locked host memory with asynchronous copies and one
    synchronization at the end, so training is blocked only for the device-to-host copy.
    (torch's own async staging cannot copy tensors that are views into one shared buffer,
    which is what fsdp8's main weights are.)"""
    staged = _copy_to_host(obj)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def _copy_to_host(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return DTensor(_copy_to_host(obj._local_tensor), obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if not t.is_cuda:
            return t.to("cpu", copy=True)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
    if isinstance(obj, dict):
        return {k: _copy_to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_to_host(v) for v in obj)
    return obj


def _checkpoint_group():
    """A gloo group of its own, so background saves never interleave with training collectives."""
    global _CKPT_GROUP
    if _CKPT_GROUP is None:
        _CKPT_GROUP = dist.new_group(backend="gloo")
    return _CKPT_GROUP


def wait_for_saves() -> None:
    """Block until every asynchronous save of this process has been published."""
    while _PENDING:
        _PENDING.pop(0).result()


def save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, extra: Optional[dict] = None,
         *, keep_last: Optional[int] = None, async_save: bool = False, max_in_flight: int = 1) -> Optional[Future]:
    """Write a reshardable, atomic checkpoint of ``model`` (and ``optimizer``) to ``path``.

    ``extra`` (JSON values and tensors, e.g. step, RNG states, data position) is stored per
    rank. ``keep_last=N`` deletes all but the N highest steps of ``path``'s series: the
    complete checkpoints beside it named like it with another number (``step-000120`` is step
    120 of ``step-``; a name without a number rotates nothing). With
    ``async_save`` the state is copied to host memory (training waits only for that), the
    call returns a Future, and a background thread writes and publishes the files over a
    gloo group of its own (at most ``max_in_flight`` saves at once: a new one first waits
    for the oldest)."""
    init_distributed()
    path = os.path.abspath(path)
    rank = dist.get_rank()
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    check_same_everywhere([f"path={path}", f"optimizer={optimizer is not None}", f"async={async_save}",
                           f"keep_last={keep_last}"], "the checkpoint to save", dist.group.WORLD, current_device())
    while async_save and len(_PENDING) >= max_in_flight:
        _PENDING.pop(0).result()
    if rank == 0:
        store.prepare(path)
    _barrier()
    tmp = store.partial_path(path)
    _agree("write the extra values", _write_extra, store.extra_path(tmp, rank), extra or {})
    _agree_delayed_pending(model)
    state = _state(model, optimizer)
    info = {"world_size": dist.get_world_size(), "optimizer": optimizer is not None}

    def finish(group) -> None:
        _barrier(group)  # every rank's files are written
        _agree("publish the checkpoint", _publish if rank == 0 else None, path, info, keep_last, group=group)

    if not async_save:
        dcp_call(dcp.save, state, storage_writer=SafeWriter(tmp))
        _fault_point("before_publish")
        finish(None)
        return None
    group = _checkpoint_group()
    staged = _stage_to_host(state)  # the only part training waits for
    done: Future = Future()

    def background() -> None:
        try:
            dcp_call(dcp.save, staged, storage_writer=SafeWriter(tmp), process_group=group)
            finish(group)
            done.set_result(path)
        except BaseException as e:  # surfaced through the Future
            done.set_exception(e)

    threading.Thread(target=background, name="fsdp8-checkpoint", daemon=True).start()
    _PENDING.append(done)
    return done


def _write_extra(file: str, values: dict) -> None:
    encoded = extra_values.encode(values)  # a TypeError names what cannot be stored
    try:
        store.write_json_atomic(file, encoded)
    except OSError as e:
        raise store.CheckpointError(f"cannot write checkpoint file {file}: {e.strerror or e}") from None


def _publish(path: str, info: dict, keep_last: Optional[int]) -> None:
    """Rank 0, once every rank's files are written: checksums, marker, rename, rotation."""
    try:
        info = dict(info, checksums=checksums.gather(store.partial_path(path)))
        store.publish(path, info)
    except OSError as e:
        raise store.CheckpointError(f"cannot publish checkpoint {path}: {e.strerror or e} "
                                    f"({e.filename or 'its marker'})") from None
    if keep_last is not None:
        store.prune(os.path.dirname(path), keep_last, protect=path)


def _agree(what: str, step, *args, group=None) -> None:
    """Run ``step(*args)`` where given (None: nothing to do on this rank), then agree with the
    other ranks (one all-reduce) whether it worked: where it failed it raises, and every other
    rank raises a CheckpointError saying so, instead of waiting for it in a collective."""
    error = None
    if step is not None:
        try:
            step(*args)
        except Exception as e:
            error = e
    failed = torch.tensor([0.0 if error is None else 1.0], device=current_device() if group is None else "cpu")
    if dist.get_world_size(group) > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item() > 0:
        raise store.CheckpointError(f"could not {what}: another rank failed (its error says why)")


def dcp_call(fn, *args, **kwargs) -> None:
    """A DCP save or load; DCP gathers every rank's exception into one CheckpointException on
    all ranks: if all were CheckpointErrors (fsdp8's own checks), they become one again (of
    their class, if they share one)."""
    try:
        fn(*args, **kwargs)
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values()]
        if not errors or not all(isinstance(exc, store.CheckpointError) for exc in errors):
            raise
        kind = type(errors[0]) if all(type(exc) is type(errors[0]) for exc in errors) else store.CheckpointError
        raise kind("; ".join(dict.fromkeys(str(exc) for exc in errors))) from None


def _fault_point(name: str) -> None:
    """Test seam: FSDP8_FAULT=<name> kills this process here (the SIGKILL-during-save test)."""
    if os.environ.get("FSDP8_FAULT") == name:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _check_loadable(path: str) -> Inspection:
    """What examine found of ``path`` for this rank, or one CheckpointError on every rank naming
    all that is wrong."""
    found = examine(path, dist.get_rank())
    # Agree before anything collective: one rank's missing file must not hang the others.
    flag = torch.tensor([1.0 if found.problems else 0.0], device=current_device())
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        raise store.CheckpointError("cannot load checkpoint: " + ("; ".join(found.problems) if found.problems else
                                                                   "another rank found it incomplete or damaged"))
    return found


def _nested(metadata) -> bool:
    """fsdp8 (and torch's get_state_dict convention) nests the model under "model."; a
    checkpoint of a bare model state dict has the parameter names at the top level."""
    return any(k.startswith("model.") for k in metadata.state_dict_metadata)


def _check_keys(model_sd: Dict[str, Any], metadata, strict: bool) -> None:
    if _nested(metadata):
        saved = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    else:
        saved = dict(metadata.state_dict_metadata)
    missing = [k for k in model_sd if k not in saved]
    unexpected = [k for k in saved if k not in model_sd]
    mis_shaped = []
    for k, v in model_sd.items():
        meta = saved.get(k)
        if not isinstance(meta, TensorStorageMetadata) or not isinstance(v, torch.Tensor):
            continue
        if tuple(meta.size) != tuple(v.shape):
            mis_shaped.append(f"{k}: checkpoint {tuple(meta.size)} vs model {tuple(v.shape)}")
        elif not same_kind(meta.properties.dtype, v.dtype):
            mis_shaped.append(f"{k}: checkpoint {meta.properties.dtype} vs model {v.dtype}")
    if mis_shaped or (strict and (missing or unexpected)):
        raise StateDictError(f"checkpoint does not match the model: {describe_mismatch(missing, unexpected, mis_shaped)}")


def load(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, strict: bool = True) -> dict:
    """Load a checkpoint written by ``save`` (at any world size, strategy or mesh) into
    ``model`` and ``optimizer`` in place; returns this rank's ``extra`` (rank 0's when the
    checkpoint was written by fewer ranks).

    Before anything is read every rank checks the checkpoint (``verify.examine``: files,
    metadata, chunks, extra values) and all raise one CheckpointError if any rank found a
    problem; a tensor must hold the model's dtype, or both must be floating point (a bf16
    checkpoint into fp32 weights). Each stored item is checked against its checksum as it is
    read: a DamagedCheckpointError on every rank then means the model (and optimizer) hold a
    mix of old and loaded values."""
    init_distributed()
    path = os.path.abspath(path)
    check_same_everywhere([f"path={path}", f"optimizer={optimizer is not None}"], "the checkpoint to load",
                          dist.group.WORLD, current_device())
    found = _check_loadable(path)
    metadata = found.metadata
    state = _state(model, optimizer)
    _check_keys(state["model"], metadata, strict)
    if optimizer is not None and not any(k.startswith("optim.") for k in metadata.state_dict_metadata):
        raise store.CheckpointError(f"{path} holds no optimizer state; load it with optimizer=None")
    target = state if _nested(metadata) else state["model"]
    dcp_call(dcp.load, target, storage_reader=SafeReader(path, metadata, found.table),
              planner=SafeLoadPlanner(allow_partial_load=not strict))
    engine = getattr(model, "_fsdp8", None)
    if engine is not None:  # main weights changed under the engine: refresh compute copies
        for unit in engine.all_units:
            unit.mark_stale()
    # Delayed-scaling states, of Float8Linears and of FP8 experts (fp8/grouped_delayed.py).
    linears = [m._delayed for m in model.modules() if getattr(m, "_delayed", None) is not None]
    for delayed in linears + all_delayed_experts(model):
        delayed.dirty = True  # restored amaxes not yet folded into the history
        # DCP wrote the scales in place, past the modules' state-dict hooks. (Under the engine
        # its scale refresh before each forward rewrites the inverses anyway.)
        delayed.refresh_inverses()
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return found.extra
