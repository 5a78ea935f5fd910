"""ShardedUnit: the buffers of one unit and its gather, reshard and gradient-reduce steps.

A unit owns three kinds of storage (sizes from ``layout.py``):

- ``main``: this rank's chunk of every parameter in ``main_dtype``, one flat tensor; each
  parameter the optimizer sees is a ``Shard(0)`` (or ``Replicate``) DTensor viewing it.
- ``unsharded``: every parameter in full, param-major, in the compute dtype; module code
  sees plain ``nn.Parameter`` aliases of it. ZeRO-3 frees it between uses (the storage is
  resized to 0, so the aliases survive); ZeRO-0/1/2 keep it and refresh it after each
  optimizer step. With one chunk and no dtype change it *is* ``main`` (no copy at all).
- gradient buffers: unsharded gradients are packed rank-major (``pack.py``),
  reduced, and land in one flat main-dtype buffer that the DTensor ``.grad`` views share
  (``unit_grads.py``, the gradient half of the class).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..config import Precision
from ..distributed import comm
from .dtensor_params import InnerSpec, combined_placement, contiguous_stride
from .layout import ParamLayout, UnitLayout
from .topology import Topology
from .unit_grads import GradientReduction


class UnitState(enum.Enum):
    SHARDED = "sharded"  # no unsharded storage
    GATHERING = "gathering"  # all-gather issued on the gather stream, not yet waited for
    UNSHARDED = "unsharded"  # unsharded storage valid for compute


@dataclass
class ParamSlot:
    """One distinct parameter of a unit and every (module, name) it is registered under."""

    fqn: str
    aliases: List[Tuple[nn.Module, str]]
    layout: ParamLayout
    requires_grad: bool
    main: Optional[nn.Parameter] = None  # DTensor over the main chunk
    compute: Optional[nn.Parameter] = None  # alias into the unsharded buffer (a DTensor under TP)
    spec: Optional[DTensorSpec] = None
    inner: Optional[InnerSpec] = None  # placement on the tensor-parallel mesh (dtensor_params.py)


def alias_storage(buffer: torch.Tensor, byte_offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A ``dtype`` tensor on ``buffer``'s storage at ``byte_offset``, with its *own* version counter.

    Autograd checks the version of tensors saved for backward; refilling the unsharded
    buffer before backward must not count as modifying the parameters saved in forward."""
    if byte_offset % dtype.itemsize:
        raise ValueError(f"byte offset {byte_offset} is not aligned to {dtype}")
    alias = torch.empty(0, dtype=dtype, device=buffer.device)
    alias.set_(buffer.untyped_storage(), byte_offset // dtype.itemsize, torch.Size(shape))
    return alias


class ShardedUnit(GradientReduction):
    """Buffers and collectives of one unit (a module and the parameters it owns)."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        slots: List[ParamSlot],
        layout: UnitLayout,
        topology: Topology,
        precision: Precision,
        device: torch.device,
        streams: comm.Streams,
        reshard_after_forward: bool,
        offload: bool = False,
    ):
        self.name = name or "<root>"
        self.module = module
        self.slots = slots
        self.layout = layout
        self.topology = topology
        self.precision = precision
        self.device = device
        # CPU offload: main weights and their gradients live in (pinned) host memory, where
        # the optimizer steps; gathers copy the chunk in, reductions copy the result out.
        self.offload = offload
        self.host = torch.device("cpu") if offload else device
        self.streams = streams
        self.compute_dtype = precision.compute_dtype
        self.reduce_dtype = precision.grad_reduce_dtype
        self.main_dtype = precision.main_dtype
        self.shards_params = topology.strategy.shards_params
        self.reshard_after_forward = reshard_after_forward and self.shards_params
        plan = topology.plan
        self.chunk_index = plan.chunk_index
        self.two_hop = self.shards_params and plan.outer_sharded
        # What travels in all-gathers and what modules compute with: the compute dtype in the
        # main layout here; FP8 units (fp8_unit.py) send bytes in a layout of their own.
        self.wire_layout, self.wire_dtype = self._plan_wire()
        self.aliased = layout.num_chunks == 1 and self.wire_dtype == self.main_dtype and not offload

        self.main = self._host_buffer(layout.chunk_numel, zero=True)
        if self.aliased:
            self.unsharded = self.main
        else:
            self.unsharded = torch.empty(self.wire_layout.unsharded_numel, dtype=self.wire_dtype, device=device)
        # ZeRO-3 + outer optim keeps this rank's R outer chunks between steps (see topology.py).
        self.outer_cache: Optional[torch.Tensor] = None
        self.state = UnitState.UNSHARDED if self.aliased else UnitState.SHARDED
        self._gather_event = None
        self.exposes_compute = False
        # Staleness of persistent compute copies: optimizer steps and in-place edits.
        self.step_generation = 0
        self._synced = None
        self.grad_acc: Optional[torch.Tensor] = None  # ZeRO-0/1 unsynced unsharded grads
        self.grad_acc_full = False
        self.shard_acc: Optional[torch.Tensor] = None  # HSDP: reduce-scattered, not yet across replicas
        # Weak references: the optimizer's .grad DTensors own the gradient buffer, so that
        # zero_grad(set_to_none=True) frees it.
        self._grad_buffer_ref = None
        self._grad_refs: List[weakref.ref] = []
        self.trainable_slots = [s for s in slots if s.requires_grad]
        self._make_params()
        if not self.aliased:
            # Aliases are made while the storage has its full size (set_ would grow it).
            self._free_unsharded()

    # -- construction --------------------------------------------------------------------
    def _host_buffer(self, numel: int, zero: bool = False) -> torch.Tensor:
        """A main-dtype buffer where main weights and their gradients live (pinned when
        offloaded next to a GPU, so copies to and from it run asynchronously)."""
        pin = self.offload and torch.cuda.is_available()
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=self.main_dtype, device=self.host, pin_memory=pin)

    def _plan_wire(self) -> Tuple[UnitLayout, torch.dtype]:
        return self.layout, self.compute_dtype

    def _compute_local(self, slot: ParamSlot) -> torch.Tensor:
        """What the module computes with, as a plain tensor over the unsharded buffer."""
        p = slot.layout
        offset = p.unsharded_offset * self.unsharded.element_size()
        return alias_storage(self.unsharded, offset, self.compute_dtype, p.shape)

    def _make_compute_param(self, slot: ParamSlot) -> nn.Parameter:
        local = self._compute_local(slot)
        value = slot.inner.wrap(local) if slot.inner is not None and slot.inner.computes_as_dtensor else local
        return nn.Parameter(value, requires_grad=slot.requires_grad)

    @staticmethod
    def compute_local(slot: ParamSlot) -> torch.Tensor:
        """The plain tensor behind ``slot.compute`` (its local piece under TP)."""
        c = slot.compute
        return c._local_tensor if isinstance(c, DTensor) else c

    def _make_params(self) -> None:
        dp_mesh, dp_placements = self.topology.main_placement()
        for slot in self.slots:
            mesh, placements, shape = dp_mesh, dp_placements, slot.layout.shape
            if slot.inner is not None:
                mesh, placements = combined_placement(dp_mesh, dp_placements, slot.inner)
                shape = slot.inner.shape
            local = self._chunk_view(self.main, slot)
            meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), self.main_dtype)
            slot.spec = DTensorSpec(mesh, placements, tensor_meta=meta)
            slot.main = nn.Parameter(
                DTensor(local, slot.spec, requires_grad=False), requires_grad=slot.requires_grad
            )
            slot.compute = self._make_compute_param(slot)

    def main_view(self, slot: ParamSlot) -> torch.Tensor:
        """This rank's rows of ``slot``'s parameter inside ``main``."""
        return slot.main._local_tensor

    def load_full(self, slot: ParamSlot, full: torch.Tensor) -> None:
        """Copy this rank's part of a full (global, unsharded) tensor into the main chunk."""
        self.load_local(slot, slot.inner.local_piece(full) if slot.inner is not None else full)

    def load_local(self, slot: ParamSlot, local: torch.Tensor) -> None:
        """Copy this rank's rows of its tensor-parallel piece (the full tensor without TP)."""
        start, stop = slot.layout.chunk_row_range(self.chunk_index)
        with torch.no_grad():
            self.main_view(slot).copy_(local[start:stop])
        self.mark_stale()

    # -- staleness -------------------------------------------------------------------------
    def _version_key(self):
        return (self.step_generation, sum(s.main._version for s in self.slots))

    def mark_stale(self) -> None:
        self.step_generation += 1

    def _persistent_copy_stale(self) -> bool:
        return self._synced != self._version_key()

    # -- gather ----------------------------------------------------------------------------
    def needs_gather(self) -> bool:
        if self.aliased:
            return False
        if self.state is UnitState.SHARDED:
            return True
        if self.shards_params:
            return False
        return self.state is UnitState.UNSHARDED and self._persistent_copy_stale()

    # Whether this unit's gather reads the FP8 scales agreed before each forward (fp8_unit.py).
    gather_needs_scales = False

    def gather(self) -> None:
        """Issue the all-gather(s) that make ``unsharded`` valid; returns before they finish."""
        if not self.needs_gather():
            return
        streams, topo = self.streams, self.topology
        n, m = self.wire_layout.num_chunks, self.wire_layout.chunk_numel
        self._allocate_unsharded()
        refresh_outer = self.two_hop and (self.outer_cache is None or self._persistent_copy_stale())
        if self.two_hop and self.outer_cache is None:
            self.outer_cache = torch.empty(topo.plan.replicate_size * m, dtype=self.wire_dtype, device=self.device)
        streams.gather.wait_stream(streams.compute())
        with streams.use(streams.gather):
            # Temporaries below live and die on the gather stream.
            if n == 1:
                # One chunk: the chunk layout already is the param-major layout.
                self._pack(self.unsharded)
            elif self.two_hop:
                if refresh_outer:
                    r = topo.plan.replicate_rank
                    own = self.outer_cache[r * m : (r + 1) * m]  # gathered in place
                    self._pack(own)
                    comm.all_gather(self.outer_cache, own, topo.replicate_group, f"{self.name}/outer")
                gathered = torch.empty(n * m, dtype=self.wire_dtype, device=self.device)
                comm.all_gather(gathered, self.outer_cache, topo.shard_group, self.name)
                self._copy_out_shard_major(gathered.view(topo.plan.shard_size, topo.plan.replicate_size, m))
            else:
                gathered = torch.empty(n * m, dtype=self.wire_dtype, device=self.device)
                send = self._ready_chunk()
                if send is None:
                    k = self.chunk_index
                    send = gathered[k * m : (k + 1) * m]  # converted straight into place
                    self._pack(send)
                comm.all_gather(gathered, send, topo.main_group, self.name)
                self._copy_out(gathered.view(1, n, m))
            self._after_gather()
        self._gather_event = streams.record(streams.gather)
        if not self.shards_params or self.two_hop:
            self._synced = self._version_key()
        self.state = UnitState.GATHERING

    def _allocate_unsharded(self) -> None:
        """Give the gathered parameters their memory again. Shared with the compute stream, so
        allocated there, before the gather stream takes over (comm.py [Note: streams and memory])."""
        if self.unsharded.untyped_storage().nbytes() != self.unsharded_nbytes:
            self.unsharded.untyped_storage().resize_(self.unsharded_nbytes)

    def _free_unsharded(self) -> None:
        """Release the gathered parameters' memory; every view of it stays valid for the next gather."""
        self.unsharded.untyped_storage().resize_(0)

    def _pack(self, dest: torch.Tensor) -> None:
        """Write this rank's chunk, as it travels, into ``dest`` (on the gather stream)."""
        dest.copy_(self.main, non_blocking=self.offload)

    def _ready_chunk(self) -> Optional[torch.Tensor]:
        """This rank's chunk if it already exists in wire form (then it is sent as is)."""
        return self.main if self.wire_dtype == self.main_dtype and not self.offload else None

    def _after_gather(self) -> None:
        """Work on the gathered parameters before compute may use them (on the gather stream)."""

    @property
    def unsharded_nbytes(self) -> int:
        return self.wire_layout.unsharded_numel * self.unsharded.element_size()

    def _regions(self):
        """(offset, numel, per-chunk numel) of each parameter's padded region (and of the
        trailing chunk padding) in ``unsharded``, in wire-layout order."""
        layout = self.wire_layout
        regions = [(p.unsharded_offset, p.padded_numel, p.chunk_numel) for p in layout.params]
        if layout.padding:
            regions.append((layout.unsharded_numel - layout.num_chunks * layout.padding,
                            layout.num_chunks * layout.padding, layout.padding))
        return regions

    def _copy_out(self, source: torch.Tensor) -> None:
        """Rank-major gathered chunks ``[A, B, M]`` (contiguous) -> param-major padded parameters."""
        a, b = source.shape[0], source.shape[1]
        outs = [self.unsharded[o : o + n].view(a, b, c) for o, n, c in self._regions()]
        torch.split_with_sizes_copy(source, list(self.wire_layout.split_sizes), dim=2, out=outs)

    def _copy_out_shard_major(self, source: torch.Tensor) -> None:
        """The two-hop gather's ``[S, R, M]`` (chunk ``r * S + s`` at ``[s, r]``) -> param-major
        padded parameters, one strided copy per region.

        Not split_with_sizes_copy: its CUDA fast path ignores the strides of a transposed
        source or destination (wrong weights for ZeRO-3 + outer optim over NCCL, torch 2.11;
        its CPU kernel is right), while copy_ handles any strides."""
        s, r = source.shape[0], source.shape[1]
        start = 0
        for offset, numel, per_chunk in self._regions():
            dest = self.unsharded[offset : offset + numel].view(r, s, per_chunk)
            dest.copy_(source[:, :, start : start + per_chunk].transpose(0, 1))
            start += per_chunk

    def wait_gather(self) -> None:
        """Make the compute stream wait for this unit's gather and drop its temporaries."""
        if self.state is UnitState.GATHERING:
            self.streams.wait(self._gather_event)
            self._gather_event = None
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters (ZeRO-3 only; others keep them between steps)."""
        if not self.shards_params or self.aliased or self.state is UnitState.SHARDED:
            return
        self.wait_gather()
        self._free_unsharded()
        self.state = UnitState.SHARDED

    def register(self, compute: bool) -> None:
        """Point the modules' attributes at the compute parameters or back at the main DTensors."""
        for slot in self.slots:
            param = slot.compute if compute else slot.main
            for module, attr in slot.aliases:
                module._parameters[attr] = param
        self.exposes_compute = compute

    def _chunk_view(self, buffer: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """This rank's rows of ``slot`` inside a flat chunk-layout buffer (main or grads)."""
        offset, numel, shape = slot.layout.chunk_extent(self.chunk_index)
        return buffer[offset : offset + numel].view(shape)

    # -- accounting ------------------------------------------------------------------------
    def persistent_compute_bytes(self) -> int:
        """Bytes of compute copies kept between steps (beyond the main chunk)."""
        if self.aliased:
            return 0
        if not self.shards_params:
            return self.unsharded_nbytes
        if self.two_hop:
            return self.topology.plan.replicate_size * self.wire_layout.chunk_numel * self.unsharded.element_size()
        return 0

