"""The gradient half of a ShardedUnit: after a unit's backward, take its unsharded
gradients, pack them rank-major in the reduce dtype (``pack.py``), reduce them over the
topology's steps (reduce-scatter, all-reduce; ZeRO-0/1 into a persistent accumulator) on the
reduce stream, and land the result in the flat main-dtype buffer that the parameters'
DTensor ``.grad`` views share. The parameter half (main chunk, gather, reshard) is
``unit.py``; ShardedUnit is both."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed import comm
from .dtensor_params import partial_dims, to_placements
from .pack import pack_rank_major


@dataclass
class PendingReduce:
    """Buffers a gradient reduction still reads or writes, and the event that ends it."""

    event: Optional[object]
    buffers: List[torch.Tensor] = field(default_factory=list)


class GradientReduction:
    """Mixed into ShardedUnit, whose buffers, layout, topology and streams it uses."""

    def has_unsharded_grads(self) -> bool:
        return any(s.compute.grad is not None for s in self.trainable_slots)

    def _take_unsharded_grads(self) -> List[torch.Tensor]:
        """The unsharded gradients as plain (tp-local) tensors, in trainable-slot order."""
        grads, partial = [], []
        for slot in self.trainable_slots:
            g = slot.compute.grad
            slot.compute.grad = None
            if g is None:
                g = torch.zeros(slot.layout.shape, dtype=self.compute_dtype, device=self.device)
            elif slot.inner is not None and isinstance(g, DTensor) and partial_dims(g) == tuple(range(slot.inner.mesh.ndim)) == (0,) \
                    and slot.inner.is_replicated and g.placements[0].reduce_op == "sum":
                partial.append(len(grads))
                g = g._local_tensor
            elif slot.inner is not None:
                g = to_placements(g, slot.inner)
            grads.append(g)
        if partial:
            self._sum_partials(grads, partial)
        return grads

    def _sum_partials(self, grads: List[torch.Tensor], indices: List[int]) -> None:
        """Sum the partial gradients of tp-replicated weights over tp, in one all-reduce.

        Under sequence parallelism a norm weight sees only this rank's tokens, so its gradient
        is a partial sum (torch marks it ``Partial``); every such gradient of the unit travels
        in one flat buffer instead of one collective each."""
        group = self.trainable_slots[indices[0]].inner.mesh.get_group(0)
        flat = torch.cat([grads[i].reshape(-1) for i in indices])
        comm.all_reduce(flat, group, dist.ReduceOp.SUM, f"{self.name}/tp partial grads")
        for i, piece in zip(indices, torch.split(flat, [grads[i].numel() for i in indices])):
            grads[i] = piece.view(grads[i].shape)

    def reduce_grads(self, sync: bool) -> Optional[PendingReduce]:
        """Pack, reduce and land this backward's gradients; returns what the reduction holds.

        ZeRO-0/1 add the packed gradients to a persistent unsharded accumulator and reduce
        it only when ``sync``. ZeRO-2/3 reduce-scatter every backward; inside ``no_sync``
        an HSDP run defers just the cross-replica all-reduce (``shard_acc``)."""
        if not self.trainable_slots:
            return None
        streams = self.streams
        n, mt = self.layout.num_chunks, self.layout.trainable_numel
        # The unsharded gradients come from the compute stream: they stay referenced until
        # the compute stream has waited for this reduction (the returned PendingReduce).
        grads = self._take_unsharded_grads()
        unsharded_grads = self.topology.grads_unsharded
        communicate = sync or not unsharded_grads
        steps = self.topology.grad_reduce_steps(sync) if communicate else []
        deferred = communicate and len(steps) < len(self.topology.grad_reduce_steps(True))
        landing = self._prepare_landing() if communicate and not deferred else None  # compute-stream buffer
        streams.reduce.wait_stream(streams.compute())
        with streams.use(streams.reduce):
            # Every other buffer here lives only on the reduce stream.
            if unsharded_grads:
                if self.grad_acc is None:
                    self.grad_acc = torch.empty(n, mt, dtype=self.reduce_dtype, device=self.device)
                if self.grad_acc_full:
                    packed = torch.empty_like(self.grad_acc)
                    self._pack_grads(grads, packed)
                    self.grad_acc.add_(packed)
                else:
                    self._pack_grads(grads, self.grad_acc)
                self.grad_acc_full = not sync
                packed = self.grad_acc
            else:
                if self._lands_in_place(steps, landing):
                    # Nothing to communicate (groups of one rank): pack straight into the new
                    # gradient buffer rather than into a second buffer of the unit's size.
                    packed = landing[1].view(n, mt)
                else:
                    packed = torch.empty(n, mt, dtype=self.reduce_dtype, device=self.device)
                self._pack_grads(grads, packed)
            if communicate:
                outs = self._allocate_step_outputs(steps, n * mt, landing)
                result = self._run_steps(steps, outs, packed.view(-1))
                if deferred:
                    if self.shard_acc is None:
                        self.shard_acc = result
                    else:
                        self.shard_acc.add_(result)
                else:
                    self._land(result, landing)
        return PendingReduce(streams.record(streams.reduce), grads)

    def _lands_in_place(self, steps, landing) -> bool:
        """Whether the reduction is the identity, so the packed gradients can be written
        where they land: every group has one rank, and a fresh fp32 buffer awaits them (which
        the last reduce-scatter would write anyway, see ``_allocate_step_outputs``)."""
        return (landing is not None and landing[0] == "fresh" and self.reduce_dtype == self.main_dtype
                and not self.offload and any(op == "rs" for op, _ in steps)
                and all(comm.group_size(g) == 1 for _, g in steps))

    def _pack_grads(self, grads: List[torch.Tensor], out: torch.Tensor) -> None:
        pack_rank_major(grads, [slot.layout for slot in self.trainable_slots], out)

    def _allocate_step_outputs(self, steps, numel: int, landing) -> List[Optional[torch.Tensor]]:
        """One output per reduce-scatter (None for in-place all-reduces); the last one may be
        the fresh main-grad buffer itself, saving a copy."""
        outs: List[Optional[torch.Tensor]] = []
        last_rs = max((i for i, (op, _) in enumerate(steps) if op == "rs"), default=None)
        direct = (landing is not None and landing[0] == "fresh" and self.reduce_dtype == self.main_dtype
                  and not self.offload)
        for i, (op, group) in enumerate(steps):
            if op != "rs":
                outs.append(None)
                continue
            numel //= comm.group_size(group)
            if i == last_rs and direct:
                outs.append(landing[1])
            else:
                outs.append(torch.empty(numel, dtype=self.reduce_dtype, device=self.device))
        return outs

    def _run_steps(self, steps, outs, buf: torch.Tensor) -> torch.Tensor:
        first_rs = True
        for (op, group), out in zip(steps, outs):
            if op == "rs":
                comm.reduce_scatter_avg(out, buf, group, self.name)
                buf = out
                if first_rs and self.shard_acc is not None:
                    # Micro-batches reduce-scattered under no_sync join before the all-reduce.
                    buf.add_(self.shard_acc)
                    self.shard_acc = None
                first_rs = False
            else:
                comm.all_reduce_avg(buf, group, self.name)
        return buf

    def _prepare_landing(self):
        """Where the reduced gradient goes: added to our current grads, or a new buffer."""
        current = [s.main.grad for s in self.trainable_slots]
        buffer = self._grad_buffer_ref() if self._grad_buffer_ref is not None else None
        ours = buffer is not None and len(self._grad_refs) == len(current) and all(
            g is not None and g is ref() for g, ref in zip(current, self._grad_refs)
        )
        if ours:
            return ("add", buffer)
        buffer = self._host_buffer(self.layout.trainable_numel)
        return ("fresh" if all(g is None for g in current) else "merge", buffer)

    def _land(self, result: torch.Tensor, landing) -> None:
        kind, buffer = landing
        if kind == "add":
            # Offloaded: the host adds, so it needs the values now (accumulation without no_sync).
            buffer.add_(result.to(buffer.device) if self.offload else result)
            return
        if result.data_ptr() != buffer.data_ptr():
            # A fresh host buffer is read only after the end of backward, which waits for the
            # copy; a merge adds on the host at once.
            buffer.copy_(result, non_blocking=self.offload and kind == "fresh")
        if kind == "merge":  # some grads exist already (e.g. assigned by the user): add them
            for slot in self.trainable_slots:
                g = slot.main.grad
                if g is not None:
                    self._chunk_view(buffer, slot).add_(g._local_tensor if isinstance(g, DTensor) else g)
        self._grad_buffer_ref = weakref.ref(buffer)
        self._grad_refs = []
        for slot in self.trainable_slots:
            grad = DTensor(self._chunk_view(buffer, slot), slot.spec, requires_grad=False)
            slot.main.grad = grad
            self._grad_refs.append(weakref.ref(grad))
