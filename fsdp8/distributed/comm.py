"""Collectives on side streams: one place where fsdp8 talks to torch.distributed.

[Note: streams and memory]
On CUDA, parameter all-gathers run on ``gather_stream`` and gradient reductions on
``reduce_stream``, ordered against the compute stream with events only, never with a host
synchronization. The caching allocator keeps a pool per stream and reuses a freed block
only for later work of the stream it was allocated on, which gives two rules:

- A buffer that only a side stream touches (the all-gather output, the packed gradients,
  intermediate reduce outputs) is allocated on that side stream and released as soon as
  its last use is enqueued: later allocations of that stream queue behind the use.
- A buffer shared with the compute stream (the unsharded parameters, the gradients
  autograd produced, the landed main-weight gradients) is allocated on the compute
  stream, the side stream first waits for the compute stream, and the buffer is released
  only after the compute stream has waited for the side stream's event.

No ``record_stream`` is needed and memory is returned deterministically. Releasing the
side-stream temporaries at once is what keeps a prefetched unit from costing more than its
unsharded parameters.

On CPU (gloo) every collective is synchronous (waited for under the hang deadline of
watchdog.py) and the streams are stand-ins that do nothing, so the same engine code runs
in CI.

A group of one rank never issues a collective: the data is copied locally, so a single
process pays no communication cost at all.

[Note: gloo at exit]
A gloo collective runs on a worker thread of its group, which drops its reference to the
work a moment after the caller's ``wait()`` has returned. The work holds the caller's
tensors, and releasing a tensor that Python also refers to takes the GIL. A thread that
asks for the GIL once interpreter shutdown has begun is ended on the spot (pthread_exit),
and unwinding it through the work's destructor calls std::terminate: "terminate called
without an active exception", SIGABRT, after correct results (core dump: gloo ``runLoop ->
~AsyncAllreduceWork -> decref_pyobject -> take_gil -> pthread_exit``, main thread in
``Py_FinalizeEx``). ``destroy_process_group()`` prevents this by freeing the group, which
joins its workers, but only when nothing else holds the group: a ``DeviceMesh`` holds its
process groups and every DTensor (main weights, optimizer state, state dicts) holds its
mesh, so once a model is sharded, the default group outlives the user's
``destroy_process_group()`` until the interpreter tears down (torch's own FSDP2 aborts the
same way). No public call joins the workers of a group that is still referenced, so
``guard_gloo_exit`` has the main thread give up the GIL for a moment at exit, while the
interpreter is still intact: a worker waiting for it finishes the release and goes idle,
and idle workers are harmless at shutdown.
"""

from __future__ import annotations

import atexit
import contextlib
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from . import watchdog


class _NoStream:
    """Stand-in for a CUDA stream on CPU, where gloo collectives are synchronous."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return None


class Streams:
    """The compute stream and the two side streams of one engine."""

    def __init__(self, device: torch.device):
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.gather = torch.cuda.Stream(device=device, priority=-1)
            self.reduce = torch.cuda.Stream(device=device, priority=-1)
        else:
            self.gather = _NoStream()
            self.reduce = _NoStream()

    def compute(self):
        return torch.cuda.current_stream() if self.is_cuda else _NoStream()

    def use(self, stream):
        """Context manager making ``stream`` current (a no-op on CPU)."""
        if self.is_cuda:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def record(self, stream):
        """Record an event on ``stream`` (None on CPU)."""
        return stream.record_event() if self.is_cuda else None

    def wait(self, event) -> None:
        """Make the compute stream wait for ``event``."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


def all_gather_single_fn():
    """torch's one-tensor all-gather, ``dist.all_gather_single`` from torch 2.13 on (which deprecates
    ``all_gather_into_tensor``). Looked up at each call, so tests can patch either name."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single_fn():
    """torch's one-tensor reduce-scatter, ``dist.reduce_scatter_single`` from torch 2.13 on (which
    deprecates ``reduce_scatter_tensor``); looked up at each call, as ``all_gather_single_fn``."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in ``group``; None means no group at all (nothing to communicate)."""
    return 1 if group is None else dist.get_world_size(group)


def _supports_avg(tensor: torch.Tensor) -> bool:
    # NCCL averages natively; gloo (CPU) sums and we divide afterwards.
    return tensor.is_cuda


class CollectiveError(RuntimeError):
    """A collective failed (timed out, a peer died); says which one, for what, and when."""


# The training iteration (counted by the schedule at each root forward), for error messages.
iteration = [0]

# A worker needs microseconds of CPU to finish; 0.1 s covers its scheduling on a loaded host.
_GLOO_EXIT_GRACE_S = 0.1
_exit_guarded = [False]


def guard_gloo_exit() -> None:
    """Let gloo workers finish releasing their last work before the interpreter shuts
    down (see [Note: gloo at exit]); registered once per process."""
    if not _exit_guarded[0]:
        _exit_guarded[0] = True
        atexit.register(time.sleep, _GLOO_EXIT_GRACE_S)


_HANG_ADVICE = (
    "Every rank must run the same forward and backward passes of a sharded model: under ZeRO-3 each "
    "forward gathers its parameters from all ranks, so a forward on some ranks only (e.g. "
    "`if rank == 0: model.generate(...)`) waits for the others forever; run it on every rank (inside "
    "torch.no_grad() where no backward follows). A rank that is only slow (compiling, saving) can be "
    f"given longer with {watchdog.TIMEOUT_ENV}=<seconds> (0 turns this check off)."
)


@contextlib.contextmanager
def _collective(kind: str, label: str):
    with record_function(f"fsdp8::{kind}[{label}]"):
        try:
            yield
        except watchdog.Stalled as e:
            raise CollectiveError(f"{kind} for {label} at iteration {iteration[0]} {e}. {_HANG_ADVICE}") from None
        except RuntimeError as e:
            raise CollectiveError(
                f"{kind} for {label} failed at iteration {iteration[0]}: {e}. A rank that stopped "
                "or skipped a step, or a network fault, leaves the others waiting here."
            ) from e


def _run(kind: str, label: str, group, on_cuda: bool, collective: Callable[[bool], object]) -> None:
    """Issue ``collective(async_op)``. On CUDA the host does not wait for it; on gloo it is
    waited for under the hang deadline (watchdog.py [Note: finding the missing ranks])."""
    with _collective(kind, label):
        if on_cuda:
            collective(False)
        else:
            watchdog.wait(collective(True), group, f"{kind} for {label} at iteration {iteration[0]}")


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, label: str) -> None:
    """Gather ``inp`` from every rank of ``group`` into ``out`` (rank-major)."""
    if group_size(group) == 1:
        out.copy_(inp.view(out.shape))
        return
    _run("all_gather", label, group, out.is_cuda,
         lambda async_op: all_gather_single_fn()(out, inp, group=group, async_op=async_op))


def reduce_scatter_avg(out: torch.Tensor, inp: torch.Tensor, group, label: str) -> None:
    """Average ``inp`` over ``group`` and keep this rank's slice in ``out``."""
    n = group_size(group)
    if n == 1:
        if out.data_ptr() != inp.data_ptr():  # in place when the caller packed into ``out``
            out.copy_(inp.view(out.shape))
        return
    op = dist.ReduceOp.AVG if _supports_avg(out) else dist.ReduceOp.SUM
    _run("reduce_scatter", label, group, out.is_cuda,
         lambda async_op: reduce_scatter_single_fn()(out, inp, op=op, group=group, async_op=async_op))
    if not _supports_avg(out):
        out.div_(n)


def all_reduce_avg(tensor: torch.Tensor, group, label: str) -> None:
    """Average ``tensor`` in place over ``group``."""
    n = group_size(group)
    if n == 1:
        return
    op = dist.ReduceOp.AVG if _supports_avg(tensor) else dist.ReduceOp.SUM
    _run("all_reduce", label, group, tensor.is_cuda,
         lambda async_op: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))
    if not _supports_avg(tensor):
        tensor.div_(n)


def all_reduce(tensor: torch.Tensor, group, op, label: str) -> None:
    """All-reduce ``tensor`` in place with ``op`` (used for norms and checks)."""
    if group_size(group) == 1:
        return
    _run("all_reduce", label, group, tensor.is_cuda,
         lambda async_op: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def summed(tensor: torch.Tensor, groups, label: str) -> torch.Tensor:
    """``tensor`` summed over each group of ``groups`` in turn (out of place). Through torch's
    functional collectives, which torch.compile traces: for per-batch statistics computed inside
    a compiled block's forward (a router's expert counts), where the in-place ones would break
    the graph."""
    for group in groups:
        if group_size(group) > 1:
            # Labelled for the profiler in eager code; Dynamo ignores a record_function, with a warning.
            with contextlib.nullcontext() if torch.compiler.is_compiling() else \
                    record_function(f"fsdp8::all_reduce[{label}]"):
                tensor = funcol.wait_tensor(funcol.all_reduce(tensor, "sum", group))
    return tensor


# [Note: async-collective inputs]
# Under tensor parallelism a unit's input can be an ``AsyncCollectiveTensor`` (ACT): the
# embedding's ``RowwiseParallel`` hands its output back with ``redistribute(async_op=True)``
# then ``to_local()``, an ACT wrapper that requires grad (``_ToTorchTensorBackward``) around a
# plain inner tensor that does not. torch's AOTAutograd (torch 2.13; pytorch#179849) replaces a
# top-level ACT input by ``trigger_wait()``, that inner tensor, before tracing, so it traces the
# input as not requiring grad and a compiled unit hands no gradient back to it: everything
# before the first compiled unit (an embedding, the biases of a norm feeding a column-parallel
# layer) got no or a wrong gradient, silently, with aot_eager and inductor alike (Dynamo alone is
# right; pytorch#191113 proposes restoring requires_grad). So the engine waits on a unit's
# top-level ACT arguments in its pre-forward hook, outside any compiled code (``waited``): an
# identity for autograd whose output is a plain tensor. The unit would wait on it first thing
# anyway (the compiled code emits that ``trigger_wait()``; eager code waits at the first op).
# Under sequence parallelism the input is a DTensor whose local tensor is an ACT: waited on the
# same way, it becomes a DTensor over a plain tensor, like every later unit's input. Left as it
# was, the first unit's compiled code guarded on the ACT type, and the later units (the same code)
# compiled the layer a second time.
class _Waited(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.trigger_wait().view(x.shape)  # a new plain tensor: autograd gives it this node

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def waited(x):
    """``x`` as a plain tensor connected to autograd if it is an AsyncCollectiveTensor, as a DTensor
    over a plain tensor if it is a DTensor over one, else ``x`` ([Note: async-collective inputs])."""
    if isinstance(x, funcol.AsyncCollectiveTensor):
        return _Waited.apply(x)
    if isinstance(x, DTensor) and isinstance(x._local_tensor, funcol.AsyncCollectiveTensor):
        return DTensor.from_local(_Waited.apply(x.to_local()), x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
    return x


def maxed(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """``tensor``'s elementwise max over the 1-D DeviceMesh ``mesh`` (out of place), through the
    functional collectives torch.compile traces: the scale agreements of FP8 linears traced into
    a compiled layer under tensor parallelism. No profiler label: Dynamo ignores a
    record_function, with a warning."""
    if mesh.size() == 1:
        return tensor
    # Traced, the functional all-reduce comes with its wait; eagerly it is waited for at first use.
    # A wait of our own here would put a second wait in the graph: one more call a step per agreement.
    return funcol.all_reduce(tensor, "max", mesh)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: List[int], in_splits: List[int], group,
               label: str) -> None:
    """Send rows ``in_splits[j]`` of ``inp`` (in order) to rank ``j`` of ``group`` and receive
    ``out_splits[j]`` rows from it into ``out`` (rank-major): expert parallelism's dispatch.
    Runs on the caller's stream: its input is the compute just before it, and the compute
    right after it needs its output."""
    if group_size(group) == 1:
        out.copy_(inp)
        return
    _run("all_to_all", label, group, out.is_cuda,
         lambda async_op: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op))
