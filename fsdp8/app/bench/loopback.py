"""Loopback collectives: one process plays rank 0 of a world of N on one device.

Why: the 2-GPU step of a sharded model has work the 1-GPU step lacks (half-size shards, the
copy out of the gathered buffer, rank-major gradient packs, the landing of the reduced
shard, an optimizer over half the parameters). With one process at world size 1 none of it
runs, and with N real devices it hides among the collectives. Here it all runs, on one
device, with a network of infinite speed: every stack sees the same world size and the same
shard sizes as on N devices, and the step time it shows is the step minus communication.

How: torch's "fake" backend answers every question about the group (world size, ranks,
sub-groups, device meshes) and turns collectives issued from C++ into no-ops; the Python
collectives both fsdp8 and torch FSDP2 call (``all_gather_into_tensor`` / ``all_gather_single``,
``reduce_scatter_tensor`` / ``reduce_scatter_single``, ``all_reduce``, ``all_gather``,
``broadcast``) are replaced by local copies on the calling stream, as if every rank held
exactly this rank's tensors:

- all-gather writes this rank's input into every other rank's slot (the bytes an all-gather
  writes);
- reduce-scatter returns this rank's slot, times N for SUM (N equal ranks summed), once for
  AVG, MAX, MIN and pre-multiplied sums (whose factor is the 1/N the caller wants);
- all-reduce multiplies by N for SUM and leaves the tensor as is otherwise;
- broadcast leaves the tensor as is.

So losses stay finite and every rank-agreement check passes (there is only one rank's
answer), but the weights are not a real model's: rank 0's rows stand in for every rank's.
Use it to time and profile the world-N path; never to judge numerics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class DoneWork:
    """What an async collective returns: already complete (the copy is on the caller's stream,
    so stream order alone makes it visible to later work, as a wait on NCCL's stream would)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


def _world(group) -> int:
    return dist.get_world_size(group)


def _sum_factor(op, world: int) -> int:
    """N for SUM (N equal contributions); 1 for AVG, MAX, MIN and PREMUL_SUM."""
    try:
        return world if op == dist.ReduceOp.SUM else 1
    except (TypeError, RuntimeError):  # a pre-multiplied-sum op object does not compare
        return 1


def _done(async_op: bool):
    return DoneWork() if async_op else None


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    world = _world(group)
    if output_tensor.numel() != world * input_tensor.numel():
        raise ValueError(
            f"loopback all-gather: output has {output_tensor.numel()} elements, expected "
            f"{world} x {input_tensor.numel()} (world size x input)"
        )
    source = input_tensor.reshape(-1)
    for slot in output_tensor.view(world, -1):
        if slot.data_ptr() != source.data_ptr():  # an in-place gather's own slot is already there
            slot.copy_(source)
    return _done(async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    world = _world(group)
    if input.numel() != world * output.numel():
        raise ValueError(
            f"loopback reduce-scatter: input has {input.numel()} elements, expected "
            f"{world} x {output.numel()} (world size x output)"
        )
    mine = input.reshape(world, -1)[dist.get_rank(group)]
    factor = _sum_factor(op, world)
    if factor == 1:
        output.view(-1).copy_(mine)
    else:
        torch.mul(mine, factor, out=output.view(-1))
    return _done(async_op)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    factor = _sum_factor(op, _world(group))
    if factor != 1:
        tensor.mul_(factor)
    return _done(async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    for out in tensor_list:
        out.copy_(tensor)
    return _done(async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    return _done(async_op)


# (name, replacement) pairs; names missing in a torch version are skipped.
_REPLACEMENTS = (
    ("all_gather_into_tensor", all_gather_into_tensor),
    ("all_gather_single", all_gather_into_tensor),
    ("reduce_scatter_tensor", reduce_scatter_tensor),
    ("reduce_scatter_single", reduce_scatter_tensor),
    ("all_reduce", all_reduce),
    ("all_gather", all_gather),
    ("broadcast", broadcast),
)


def install() -> list[str]:
    """Replace the Python collectives in ``torch.distributed`` (and its c10d module); returns
    the names replaced."""
    replaced = []
    for name, fn in _REPLACEMENTS:
        for module in (dist, c10d):
            if hasattr(module, name):
                setattr(module, name, fn)
                if name not in replaced:
                    replaced.append(name)
    return replaced


def init_loopback(world: int) -> None:
    """Start a fake process group of ``world`` ranks in which this process is rank 0, and
    install the loopback collectives."""
    if world < 1:
        raise ValueError(f"loopback world size must be >= 1, got {world}")
    if dist.is_initialized():
        raise RuntimeError("loopback: a process group already exists; start the loopback world before any other")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    install()
