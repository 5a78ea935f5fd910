"""Expert parallelism: a mixture-of-experts model's experts split over ``ep`` ranks, each token sent
to its experts' ranks and back with all-to-all.

[Note: expert parallelism]
An experts module (found by the model's adapter, ``experts(model)``) holds its experts as 3-D
parameters, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], and is called with
transformers' experts signature ``(hidden_states [T, H], top_k_index [T, k], top_k_weights
[T, k])`` after the model's own router chose the experts. ``expert_parallel`` makes both
parameters DTensors ``Shard(0)`` on the ``ep`` dim of the experts' mesh
(``fsdp8.distributed.mesh.make_expert_mesh``), so ep rank ``j`` holds experts
``[j * E / ep, (j + 1) * E / ep)``, and replaces the module's forward by one that:

1. sorts this rank's (token, slot) pairs by expert (``fsdp8.models.moe.permute_by_expert``), so
   the rows for ep rank ``j`` are one contiguous block;
2. exchanges the per-expert row counts (an all-to-all of E integers), then the rows
   themselves (``all_to_all_single`` with those splits; its split sizes are the one host
   value per layer: NCCL takes them as host integers);
3. regroups what arrived (source-rank-major) by local expert (``permute_by_expert`` again, on
   the arrived rows' local experts) and computes every local expert
   as one grouped GEMM per projection (``fsdp8.models.moe.expert_mlp``);
4. sends the results back the same way, and sums each token's slots weighted by its routing
   weights, in the order one process sums them.

Nothing is dropped (no capacity factor), and the routing is the model's own, so each
token's result equals one process's. With an FP8 recipe (``module.fp8_recipe``, set by FP8
conversion) the grouped GEMMs run in FP8 with scales per expert; an expert's current-scaling
amax then covers every row that arrived from its ep group, the rows one process would give it
for the whole group's batch (not one rank's). The backward of each all-to-all is the opposite
all-to-all (torch.autograd).

[Note: FP8 dispatch]
With ``fp8_dispatch`` (``ParallelConfig(fp8_dispatch=True)``) the dispatch all-to-all sends each
row as e4m3 bytes followed by its fp32 scales, one per 128 values (1x128 blocks, as DeepSeek-V3
dispatches): ``H + 4 ceil(H / 128)`` bytes a row in one uint8 all-to-all, against ``2 H`` in
bf16. Each row is quantized on its own, so what arrives is the row rounded to FP8 wherever it is
computed: a run equals one process whose experts take ``rows_through_fp8`` of their input. The
rounding's gradient is the identity (the backward all-to-all sends the rows' gradients in the
compute dtype), and the combine stays in the compute dtype: it carries the experts' outputs,
which are summed per token.

Gradients: the engine shards the experts over the data-parallel ranks of the experts' mesh
(``efsdp``, with ``dp_replicate`` and ``cp`` as for dense weights) and averages their
gradients over those ranks, while a dense weight's gradient is averaged over all of
``dp_shard``. An expert's gradient on its rank already holds the contributions of every
rank of its ep group (the backward all-to-all brought them), so averaging over ``efsdp``
alone would count ``ep`` ranks' worth of data against a divisor ``ep`` times too small: the
forward scales the experts' gradients by ``1 / ep`` (``_ScaleGrad``), which makes them the
data-parallel mean that one process over the global batch computes.

[Note: experts beside tensor parallelism]
With tp > 1 the experts' mesh keeps the world's ``tp`` dim, so each tp rank has its own ep group
(the ranks of its tp coordinate) and the experts are DTensors ``(Shard(0), Replicate())`` on
``(ep, tp)``: every tp rank holds the same experts. The MoE block computes on each rank's own
tokens (fsdp8.models.tp_plan.ExpertParallelBlock). Under sequence parallelism those are this tp
rank's part of each sequence, different on every tp rank, so an expert's gradient on one tp rank
covers only its tokens: the weights are read with a ``Partial`` gradient over tp, which the engine
sums. Without it every tp rank holds the whole sequences and computes the same experts on the
same tokens; the gradient stays ``Replicate`` (summing would count the tokens tp times). The
1 / ep scale and the engine's average over the experts' data-parallel dims are as above.
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from ..distributed import comm
from ..fp8.formats import Granularity
from ..fp8.grouped import fp8_experts_forward, runs_fp8_experts
from ..fp8.grouped_kernel import bounds_of
from ..fp8.kernels import Quantized, quantize
from ..models.adapter import adapter_for
from ..models.moe import (combine_by_token, delayed_of, dispatch_rows, expert_mlp, experts_forward,
                          permute_by_expert, permute_rows)
from ..models.tp_plan import beside_router_and_experts

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertGroup:
    """The ep group one experts module is split over."""

    group: dist.ProcessGroup
    size: int
    num_experts: int
    # The experts' local weights' gradient placements on (ep, tp); None: their own (see the Note).
    grad_placements: Optional[Tuple[Placement, ...]] = None
    rank: int = 0  # this rank's index in the ep group
    fp8_dispatch: bool = False  # [Note: FP8 dispatch]

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def first_expert(self) -> int:
        """The index of this rank's first expert: experts lie rank-major."""
        return self.rank * self.local_experts


class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all`` of rows; its backward sends the gradients back the opposite way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group, label: str):
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group, label)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, ctx.group, f"{ctx.label} backward")
        return back, None, None, None, None


_DISPATCH_FP8 = torch.float8_e4m3fn


def _fp8_rows_packed(x: torch.Tensor) -> torch.Tensor:
    """``x`` [R, H] quantized in 1x128 blocks, each row its e4m3 bytes then its fp32 scales
    (as bytes): uint8 [R, H + 4 ceil(H / 128)]."""
    width = x.shape[1] + 4 * -(-x.shape[1] // 128)
    if x.shape[0] == 0:
        return x.new_empty((0, width), dtype=torch.uint8)
    q = quantize(x.contiguous(), _DISPATCH_FP8, Granularity.ROW_1x128)
    return torch.cat([q.data.view(torch.uint8), q.scale_inv.contiguous().view(torch.uint8)], dim=1)


def _fp8_rows_unpacked(packed: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``_fp8_rows_packed`` made, dequantized to ``dtype``."""
    if packed.shape[0] == 0:
        return torch.empty((0, hidden), dtype=dtype, device=packed.device)
    data = packed[:, :hidden].contiguous().view(_DISPATCH_FP8)
    scale_inv = packed[:, hidden:].contiguous().view(torch.float32)
    return Quantized(data, scale_inv, Granularity.ROW_1x128).dequantize(dtype)


class _ThroughFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor):
        return _fp8_rows_unpacked(_fp8_rows_packed(x), x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad


def rows_through_fp8(x: torch.Tensor) -> torch.Tensor:
    """What FP8 dispatch delivers of the rows ``x`` [R, H]: each rounded to e4m3 in 1x128 blocks
    (its gradient taken as the identity). One process computing its experts on this equals a run
    with ``fp8_dispatch`` ([Note: FP8 dispatch])."""
    return _ThroughFp8.apply(x)


class _Fp8AllToAll(torch.autograd.Function):
    """``_AllToAll`` of rows sent as FP8 bytes and their scales; the gradients go back in the
    compute dtype ([Note: FP8 dispatch])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group, label: str):
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        packed = _fp8_rows_packed(x)
        out = packed.new_empty((sum(out_splits), packed.shape[1]))
        comm.all_to_all(out, packed, out_splits, in_splits, group, label)
        return _fp8_rows_unpacked(out, x.shape[1], x.dtype)

    backward = staticmethod(_AllToAll.backward)


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``factor`` (see the Note)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _local(t: torch.Tensor, grad_placements: Optional[Tuple[Placement, ...]] = None) -> torch.Tensor:
    return t.to_local(grad_placements=grad_placements) if isinstance(t, DTensor) else t


def check_expert_parallel(model: nn.Module, ep: int, tp: int = 1) -> Dict[str, nn.Module]:
    """The experts modules of ``model``, after checking that ``ep`` can split them (and with
    ``tp`` > 1 that their blocks are router + experts, what ExpertParallelBlock lays out); raises
    a ValueError naming ``ep`` and the fix otherwise (before anything is communicated)."""
    experts = adapter_for(model).experts(model)
    if not experts:
        raise ValueError(
            f"ep={ep} splits the experts of a mixture-of-experts model, but {type(model).__name__} has none (its "
            "adapter found no experts module); use ep=1 for a dense model"
        )
    for name, module in experts.items():
        missing = [p for p in EXPERT_PARAMS if not isinstance(getattr(module, p, None), torch.Tensor)]
        if missing:
            raise ValueError(f"experts module {name!r} ({type(module).__name__}) has no 3-D {missing[0]!r} parameter; "
                             "expert parallelism splits experts stored as gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
        count = module.gate_up_proj.shape[0]
        if count % ep:
            raise ValueError(
                f"ep={ep} does not divide the {count} experts of {name!r}; choose ep among "
                f"{[d for d in range(1, count + 1) if count % d == 0]}"
            )
    if tp > 1:
        _check_blocks(model, experts, ep, tp)
    return experts


def _check_blocks(model: nn.Module, experts: Dict[str, nn.Module], ep: int, tp: int) -> None:
    modules = dict(model.named_modules())
    for name in experts:
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        block = modules[parent]
        outside = beside_router_and_experts(block)
        if name != f"{parent}.experts" or not isinstance(getattr(block, "gate", None), nn.Module) or outside:
            what = f"holds {outside[0]!r} beside them" if outside else "does not call them 'experts' beside a 'gate'"
            raise ValueError(
                f"ep={ep} with tp={tp}: the block {parent!r} ({type(block).__name__}) of experts {name!r} {what}; "
                "tensor parallelism lays out mixture-of-experts blocks made of a router 'gate' and 'experts' only "
                "(no shared experts yet); use tp=1 with this model"
            )


def expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, sequence_parallel: bool = False,
                    fp8_dispatch: bool = False) -> nn.Module:
    """Split ``model``'s experts over ``expert_mesh["ep"]`` and dispatch tokens to them with
    all-to-all (see [Note: expert parallelism]); returns ``model``. Call before
    ``fully_shard``, on every rank (``fsdp8.parallelize(model, ParallelConfig(ep=N))`` does).
    With a ``tp`` dim in ``expert_mesh`` the experts are replicated over it, and
    ``sequence_parallel`` says whether tp ranks hold different tokens ([Note: experts beside
    tensor parallelism]); apply ``fsdp8.parallel.tensor_parallel`` first. ``fp8_dispatch``: tokens
    travel to their experts as FP8 bytes ([Note: FP8 dispatch])."""
    ep_mesh = expert_mesh["ep"]
    tp = expert_mesh["tp"].size() if "tp" in (expert_mesh.mesh_dim_names or ()) else 1
    experts = check_expert_parallel(model, ep_mesh.size(), tp)
    mesh = expert_mesh["ep", "tp"] if tp > 1 else ep_mesh
    placements = [Shard(0)] + [Replicate()] * (tp > 1)
    grad_placements = (Shard(0), Partial()) if tp > 1 and sequence_parallel else None
    for module in experts.values():
        for name in EXPERT_PARAMS:
            param = getattr(module, name)
            placed = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
        group = ExpertGroup(ep_mesh.get_group(), ep_mesh.size(), module.gate_up_proj.shape[0], grad_placements,
                            ep_mesh.get_local_rank(), fp8_dispatch)
        module.forward = types.MethodType(_dispatching_forward(group), module)
    return model


def computed_in_fp8(model: nn.Module) -> nn.Module:
    """Give the experts modules of ``model`` whose own forward cannot take an FP8 recipe
    (transformers' experts) fsdp8's ``experts_forward``, the same computation (tests compare
    them to fp64 rounding) with grouped GEMMs that can, so FP8 conversion converts them;
    returns ``model``. ``parallelize`` calls it with an FP8 recipe and no expert parallelism
    (whose forward already can)."""
    for module in adapter_for(model).experts(model).values():
        if not runs_fp8_experts(module):
            module.forward = types.MethodType(experts_forward, module)
    return model


def _dispatching_forward(group: ExpertGroup):
    @fp8_experts_forward  # it passes the module's FP8 recipe on (fsdp8.fp8.grouped)
    def forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return dispatch_and_compute(module, group, hidden_states, top_k_index, top_k_weights)

    return forward


# Outside compiled graphs: the rows that arrive change in number every step (a recompilation
# each time), and the split sizes are host values anyway.
@torch.compiler.disable
def dispatch_and_compute(module: nn.Module, group: ExpertGroup, hidden_states: torch.Tensor,
                         top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for this rank's tokens, each computed on its expert's ep rank."""
    k = top_k_index.shape[-1]
    order, inverse, counts = permute_by_expert(top_k_index, group.num_experts)
    rows = dispatch_rows(hidden_states, order, inverse, k)
    # counts[e] rows go to expert e; experts are laid out rank-major, so row j of this
    # [ep, local] matrix is what rank j receives.
    sent = counts.view(group.size, group.local_experts)
    received = torch.empty_like(sent)  # received[j, e]: rows rank j sends to local expert e
    comm.all_to_all(received, sent, [1] * group.size, [1] * group.size, group.group, "ep token counts")
    # The one host sync: the split sizes, and each local expert's rows (FP8 expert GEMMs run
    # group by group, so they need those on the host too).
    sizes = torch.cat([sent.sum(1), received.sum(1), received.sum(0)]).tolist()
    in_splits, out_splits, expert_rows = sizes[:group.size], sizes[group.size:2 * group.size], sizes[2 * group.size:]
    send = _Fp8AllToAll if group.fp8_dispatch else _AllToAll
    arrived = send.apply(rows, out_splits, in_splits, group.group, "ep dispatch")
    scale = 1.0 / group.size
    gate_up = _ScaleGrad.apply(_local(module.gate_up_proj, group.grad_placements), scale)
    down = _ScaleGrad.apply(_local(module.down_proj, group.grad_placements), scale)
    # Delayed scaling: every rank keeps all experts' histories and records its own experts' rows
    # (fsdp8/fp8/grouped_delayed.py).
    restored = local_experts(arrived, received, gate_up, down, module.act_fn, getattr(module, "fp8_recipe", None),
                             bounds_of(list(itertools.accumulate(expert_rows))),
                             delayed_of(module, group.first_expert, group.local_experts))
    returned = _AllToAll.apply(restored, in_splits, out_splits, group.group, "ep combine")
    return combine_by_token(returned, order, inverse, top_k_weights, hidden_states)


def local_experts(arrived: torch.Tensor, received: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  act_fn, recipe=None, bounds=None, delayed=None) -> torch.Tensor:
    """The local experts' SwiGLU on the rows that ``arrived`` source-rank-major (``received[j, e]``
    of local expert ``e`` from rank ``j``), returned in arrival order: the rows regrouped by local
    expert, one grouped GEMM per projection (``expert_mlp``), and put back. ``bounds``: each local
    expert's rows on the host, where the caller has them."""
    regroup, arrival, local_counts = permute_by_expert(_local_expert_of_rows(received, arrived.shape[0]),
                                                       received.shape[1])
    computed = expert_mlp(permute_rows(arrived, regroup, arrival), local_counts, gate_up, down, act_fn,
                          recipe=recipe, bounds=bounds, delayed=delayed)
    return permute_rows(computed, arrival, regroup)


def _local_expert_of_rows(received: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1]: the local expert of each row that arrived source-rank-major (``received[j, e]``
    rows of local expert ``e`` from rank ``j``), from the counts on the device."""
    sources, local = received.shape
    expert_of_block = torch.arange(local, device=received.device).repeat(sources)
    return torch.repeat_interleave(expert_of_block, received.reshape(-1), output_size=rows).unsqueeze(-1)
