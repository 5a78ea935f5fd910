"""Mixture-of-experts building blocks, on one process: the grouped GEMM, the permutation of routed
tokens by expert, the SwiGLU experts on sorted tokens, and the built-in Llama's MoE layer (router,
experts, load-balancing loss).

[Note: the pieces of an MoE layer]
A layer routes each of its T tokens to k of E experts, then runs every expert on its tokens:

- ``permute_by_expert``: the order that sorts the T * k (token, slot) pairs by expert, its
  inverse, and how many went to each;
- ``expert_mlp``: the experts' SwiGLU on rows already sorted by expert (``grouped_mm``: one GEMM
  per expert over its contiguous rows);
- ``experts_forward``: the whole local computation, with transformers' experts signature
  (permute, gather, ``expert_mlp``, weight and sum back per token). The permutations move rows by
  gathers both ways (``permute_rows``, ``dispatch_rows``), never by scatter-adds.

Expert parallelism keeps the first two and puts its all-to-all exchanges around ``expert_mlp``.
FP8 conversion attaches its recipe to an experts module as ``fp8_recipe`` (fsdp8.fp8.convert; only
to modules whose forward is marked ``fp8_experts_forward``, as ``experts_forward`` is), and
``expert_mlp`` then runs both grouped GEMMs with ``fsdp8.fp8.grouped.fp8_grouped_mm``.
The weights have Hugging Face's names and layout (``Qwen3MoeExperts``, ``MixtralExperts``):
``gate_up_proj`` [E, 2I, H] (the gate's rows, then the up projection's) and ``down_proj`` [E, H, I].
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import comm
from ..fp8.grouped import FP8_EXPERT_WEIGHTS, fp8_experts_forward, fp8_grouped_mm
from ..fp8.grouped_delayed import delayed_experts
from ..fp8.grouped_kernel import Bounds, Groups
from ..fp8.recipes import Recipe

# -- grouped GEMM ----------------------------------------------------------------------------------
# Whether torch._grouped_mm and its backward work for (device type, dtype): probed once each.
_OP_WORKS: Dict[Tuple[str, torch.dtype], bool] = {}
# torch._grouped_mm reads its operands with vector loads: rows and base pointers on 16-byte boundaries.
_ALIGN = 16
_PLAIN = (torch.Tensor, nn.Parameter)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group g of ``x`` [T, K] times ``weight[g]``.T, for ``weight`` [G, N, K] (nn.Linear's
    layout): [T, N]. ``offs`` int32 [G]: the groups' cumulative row ends (``offs[-1] == T``); a
    group may be empty. torch's grouped GEMM where it runs, else one GEMM per group (which reads
    the group sizes on the host: one synchronisation)."""
    if _op_fits(x, weight):
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs))
    return _grouped_mm_loop(x, weight, offs)


def _grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        # As llama.Linear: torch's CPU bf16 GEMM is many times slower than the fp32 one, and an fp32
        # GEMM of bf16 values rounded once is what a bf16 GEMM computes.
        return _grouped_mm_loop(x.float(), weight.float(), offs).to(torch.bfloat16)
    sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1, dtype=torch.long)).tolist()
    return torch.cat([F.linear(rows, w) for rows, w in zip(torch.split(x, sizes), weight.unbind(0))])


def _op_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm can take these operands (its dtypes, alignment, a working kernel)."""
    if x.dtype != weight.dtype or x.dim() != 2 or weight.dim() != 3 or not hasattr(torch, "_grouped_mm"):
        return False
    if not (type(x) in _PLAIN and type(weight) in _PLAIN):
        return False  # DTensor and other subclasses: the per-group GEMMs go through their dispatch
    if torch.compiler.is_compiling() and x.is_cuda and x.dtype != torch.bfloat16:
        # CUDA's eager op takes fp32 (a fallback), but its fake kernel in torch 2.11 refuses
        # anything but bf16, so a compiled graph could not be traced through it.
        return False
    size = x.element_size()
    if not (x.is_contiguous() and weight.is_contiguous() and x.shape[1] * size % _ALIGN == 0
            and weight.shape[1] * size % _ALIGN == 0 and x.data_ptr() % _ALIGN == 0
            and weight.data_ptr() % _ALIGN == 0):
        return False
    key = (x.device.type, x.dtype)
    if key not in _OP_WORKS:
        # Out of the trace; torch.compiler.disable imports dynamo (seconds): only when tracing.
        probe = torch.compiler.disable(_probe_apart) if torch.compiler.is_compiling() else _probe_apart
        _OP_WORKS[key] = probe(x.device, x.dtype)
    return _OP_WORKS[key]


def _probe_apart(device: torch.device, dtype: torch.dtype) -> bool:
    """``_probe`` on a thread of its own. The first call may come inside an activation-checkpointed
    region, whose saved-tensor hooks and dispatch modes (selective checkpointing) would record the
    probe's tensors and ops as the region's, which its recomputation then lacks; those contexts,
    grad mode and autocast are the calling thread's, and a new thread starts without them."""
    works = []
    thread = threading.Thread(target=lambda: works.append(_probe(device, dtype)), name="fsdp8-grouped-mm-probe")
    thread.start()
    thread.join()
    return bool(works and works[0])


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm gives the per-group GEMMs' values and gradients on ``device`` in
    ``dtype`` (it exists for some dtypes, devices and GPU generations only), on a tiny problem
    with an empty group."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(6, 16, generator=g).to(device, dtype).requires_grad_()
        w = torch.randn(3, 16, 16, generator=g).to(device, dtype).requires_grad_()
        offs = torch.tensor([2, 2, 6], dtype=torch.int32, device=device)
        out = _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
        got = (out, *torch.autograd.grad(out.sum(), (x, w)))
        xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        ref = _grouped_mm_loop(xr, wr, offs)
        want = (ref, *torch.autograd.grad(ref.sum(), (xr, wr)))
        # The same (rounded) operands both ways: the tolerance is for a bf16 or fp16 result's rounding.
        return all(torch.allclose(a.float(), b, rtol=2e-2, atol=2e-2) for a, b in zip(got, want))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch._grouped_mm's backward
    refuses the stride-0 gradients of a sum or an expand."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


# -- routing and experts ---------------------------------------------------------------------------
def permute_by_expert(top_k_index: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``order`` [T * k]: the flattened (token, slot) pairs of ``top_k_index`` [T, k] sorted by
    expert, ties in token order; ``inverse``: where each pair went (``inverse[order[j]] == j``), what
    the gathers that move rows back need; ``counts`` [num_experts] int64: the pairs of each expert.
    No host synchronisation (a scatter, not bincount, which reads its maximum on the host on CUDA)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return order, inverse, counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


class _Permute(torch.autograd.Function):
    """``rows[index]`` for a permutation ``index`` whose inverse is ``inverse``, the gradient sent back
    by ``inverse``: a gather both ways. (The backward autograd gives indexing is an accumulating
    scatter, which takes atomics or a sort on GPUs although no two rows meet.)"""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def permute_rows(rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` (``index`` a permutation, ``inverse`` its inverse), differentiable by gathers."""
    return _Permute.apply(rows, index, inverse)


class _DispatchRows(torch.autograd.Function):
    """Each routed (token, slot) pair's row of ``hidden_states`` [T, H], in ``order``
    (permute_by_expert's): ``hidden_states[order // k]``. Backward: each token's k row gradients
    brought back to (token, slot) order by ``inverse`` and summed, a gather and a reduction (autograd's
    own is an accumulating scatter of k rows onto each token, which sorts the indices every time on GPUs)."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return hidden_states[order // k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse].unflatten(0, (-1, ctx.k)).sum(1), None, None, None


def dispatch_rows(hidden_states: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """``hidden_states[order // k]``: every routed pair's token row, sorted by expert (``inverse``:
    permute_by_expert's), its gradient summed per token without atomics."""
    return _DispatchRows.apply(hidden_states, order, inverse, k)


def expert_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               act_fn: Callable[[torch.Tensor], torch.Tensor], recipe: Optional[Recipe] = None,
               bounds: Optional[Bounds] = None, delayed: Optional[tuple] = None) -> torch.Tensor:
    """The experts' SwiGLU, ``down(act(gate x) * up x)``, on ``x_sorted`` [T', H] whose first
    ``counts[0]`` rows go to expert 0, the next ``counts[1]`` to expert 1, and so on. With an FP8
    ``recipe`` both grouped GEMMs run in FP8, each expert with its own scales (fsdp8.fp8.grouped):
    ``bounds`` are the groups' (first, end) rows when the caller already holds ``counts`` on the
    host, else they are read from the device once, if a GEMM goes group by group. ``delayed``:
    under DelayedScaling, the two projections' states of these experts (``delayed_of``)."""
    offs = counts.cumsum(0).to(torch.int32)
    if recipe is None:
        gate, up = grouped_mm(x_sorted, gate_up_proj, offs).chunk(2, dim=-1)
        return grouped_mm(act_fn(gate) * up, down_proj, offs)
    groups = Groups(offs, bounds)  # derived from offs once for both FP8 GEMMs (and their backward)
    gate_up_state, down_state = delayed or (None, None)
    gate, up = fp8_grouped_mm(x_sorted, gate_up_proj, offs, recipe, groups, gate_up_state).chunk(2, dim=-1)
    return fp8_grouped_mm(act_fn(gate) * up, down_proj, offs, recipe, groups, down_state)


def delayed_of(experts: nn.Module, first: int, count: int) -> Optional[tuple]:
    """The delayed-scaling states of experts ``first .. first + count - 1`` of the experts module,
    (gate_up_proj's, down_proj's), or None when it has none (fsdp8.fp8.grouped_delayed)."""
    states = [delayed_experts(experts, name) for name in FP8_EXPERT_WEIGHTS]
    if any(s is None for s in states):
        return None
    return tuple(s.local(first, count) for s in states)


@fp8_experts_forward
def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """What transformers' ``Qwen3MoeExperts.forward`` computes, with grouped GEMMs instead of a
    loop over experts: each token's ``hidden_states`` [T, H] row through its experts
    ``top_k_index`` [T, k], weighted by ``top_k_weights`` [T, k] and summed. Reads ``experts``'
    ``gate_up_proj``, ``down_proj`` and ``act_fn``, and ``fp8_recipe`` if FP8 conversion attached
    one (then the expert GEMMs run in FP8)."""
    k = top_k_index.shape[-1]
    num_experts = experts.gate_up_proj.shape[0]
    order, inverse, counts = permute_by_expert(top_k_index, num_experts)
    out = expert_mlp(dispatch_rows(hidden_states, order, inverse, k), counts, experts.gate_up_proj,
                     experts.down_proj, experts.act_fn, getattr(experts, "fp8_recipe", None),
                     delayed=delayed_of(experts, 0, num_experts))
    return combine_by_token(out, order, inverse, top_k_weights, hidden_states)


def combine_by_token(out: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k_weights: torch.Tensor,
                     hidden_states: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its experts' rows ``out`` (in ``order``, permute_by_expert's, whose inverse
    is ``inverse``), weighted by its routing weights ``top_k_weights`` [T, k]: as transformers,
    weighted in the product's dtype, summed in the hidden states'. The rows are brought back to
    (token, slot) order and reduced over the slots: a gather and a sum, deterministic (``index_add_``
    onto the tokens adds with atomics on GPUs, in an order that varies run to run)."""
    by_slot = permute_rows(out, inverse, order).unflatten(0, top_k_weights.shape)
    return (by_slot * top_k_weights.unsqueeze(-1)).to(hidden_states.dtype).sum(1)


def load_balancing_loss(router_probs: torch.Tensor, top_k: int, token_groups: Sequence = ()) -> torch.Tensor:
    """Switch Transformer's auxiliary loss of one layer's routing, E * sum_e f_e * P_e: f_e the
    fraction of the T * k routed slots that went to expert e (each token's ``top_k`` most probable,
    as the router chose them), P_e the mean of ``router_probs`` [T, E] for e over the T tokens. 1
    when the routing is uniform, E at worst. (transformers' ``load_balancing_loss_func`` counts
    f_e per token, which is k times this.) The choices are taken again from the probabilities, not
    passed in, because under tensor parallelism the probabilities cover more tokens than this
    rank routed (fsdp8.models.tp_plan.ExpertParallelBlock).

    ``token_groups``: process groups of the ranks that hold other tokens of the global batch
    (data-parallel and context-parallel ranks). With them f_e counts the whole global batch's
    slots ("global-batch" load balancing, one all-reduce of E + 1 numbers per group) while P_e
    stays this rank's; the ranks' losses averaged (as data-parallel gradients are) are then one
    process's loss on the global batch. Without, f_e and P_e are both this call's (data-parallel
    semantics: each rank's rows one batch)."""
    num_experts = router_probs.shape[-1]
    flat = torch.topk(router_probs.detach(), top_k, dim=-1).indices.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=router_probs.dtype, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=router_probs.dtype))
    counts[num_experts] = flat.numel()
    counts = comm.summed(counts, token_groups, "moe global-batch expert counts")
    return num_experts * torch.sum(counts[:num_experts] / counts[num_experts] * router_probs.mean(0))


# -- the built-in Llama's MoE layer ----------------------------------------------------------------
# Each takes the model's LlamaConfig (fsdp8.models.llama), whose MoE fields size it. As llama.py's
# [Note: initialisation lives in leaf modules only], every draw happens in the reset_parameters()
# of the module owning the parameter; MoE itself has none.
class Router(nn.Module):
    """Top-k routing as transformers' ``Qwen3MoeTopKRouter``: softmax (in fp32) of the logits
    ``weight`` x, the k most probable experts, their probabilities renormalised to sum to 1 when
    ``norm_topk_prob``, cast back to the logits' dtype."""

    is_moe_router = True  # FP8 conversion keeps it in high precision and says why

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.std = config.num_experts_per_tok, config.norm_topk_prob, config.init_std
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``x`` [T, H]: the router probabilities [T, E] (fp32), the top-k weights [T, k] and
        their experts [T, k]."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_k_weights, top_k_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return probs, top_k_weights.to(logits.dtype), top_k_index

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D parameters (transformers' names and layout, see [Note: the
    pieces of an MoE layer]); initialised as llama.FeedForward: the down projection's std is
    scaled by 1 / sqrt(2 n_layers), as every output projection into the residual stream."""

    def __init__(self, config):
        super().__init__()
        experts, dim, hidden = config.num_experts, config.dim, config.expert_ffn_dim
        self.std, self.out_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, hidden))
        self.act_fn = F.silu
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=self.std)
        nn.init.normal_(self.down_proj, mean=0.0, std=self.out_std)

    forward = experts_forward

    def extra_repr(self) -> str:
        experts, dim, hidden = self.down_proj.shape
        return f"experts={experts}, dim={dim}, hidden={hidden}, std={self.std:.3g}, out_std={self.out_std:.3g}"


class MoE(nn.Module):
    """The MoE feed-forward: route each token (``gate``), run its experts (``experts``).
    ``load_balancing_groups``: the process groups its load-balancing loss counts the experts'
    tokens over (``load_balancing_loss``'s ``token_groups``); parallelize sets them for
    ``ParallelConfig(load_balancing="global")``."""

    load_balancing_groups: Tuple = ()

    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)  # before the experts: construction draws in modules() order
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x`` [..., H] -> (the output, shaped as ``x``; this call's load-balancing loss, fp32).
        The loss is returned, not kept: a checkpointed block's recomputation repeats the forward,
        and only the first call's return value reaches the model's loss."""
        flat = x.reshape(-1, x.shape[-1])
        probs, top_k_weights, top_k_index = self.gate(flat)
        out = self.experts(flat, top_k_index, top_k_weights)
        return out.view(x.shape), load_balancing_loss(probs, top_k_index.shape[-1], self.load_balancing_groups)
