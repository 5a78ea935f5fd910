"""Activation memory: the bytes per token a decoder layer keeps from forward to backward, under each
activation-checkpointing mode, for a dense layer (docs/PLANNING.md's table derives each term) and a
mixture-of-experts layer (below).

[Note: what a mixture-of-experts layer keeps]
Attention and the two norms keep what a dense layer's do. The MLP is replaced by a router and the
experts (fsdp8/models/moe.py ``MoE``; with ep > 1 the experts' forward is fsdp8/parallel/ep.py
``dispatch_and_compute``). Per token, with k experts per token, E experts of width I, hidden H and
compute-dtype bytes e, autograd keeps:

- the router's input (the second norm's output, e H, what a dense MLP's linears keep too), the
  fp32 softmax over the experts (4 E: its backward needs its output), the top-k indices (int64,
  8 k) and the two operands of the top-k renormalisation (fp32: 4 k values, 4 for their sum);
- the k routed rows of the token: the experts' input rows after sorting by expert (e k H, kept
  by the first grouped GEMM), that GEMM's [gate; up] output (e k 2I, read by SiLU's and the
  product's backward), SiLU's output (e k I), the product (e k I, the second GEMM's input), the
  experts' output rows brought back to (token, slot) order (e k H, kept by the weighting with the
  routing weights) and those weights per row (e k); the weighted rows are summed per token by a
  reduction, which keeps nothing;
- the int64 permutations that the gathers' backward needs, 8 bytes per row each: the sort by
  expert and its inverse (2); under ep > 1 also the regrouping of arrived rows by local expert
  and its inverse (4 in all). The rows sent by the dispatch all-to-all and those
  arriving are not kept (the all-to-all's backward needs only the split sizes; the index that
  regroups them keeps only its indices).

So e k (2H + 4I + 1) + (16 or 32) k + 4 E + 12 k + 4, beside e H for the router's input. Per
layer, not per token (left out): the grouped GEMM's int32 group ends and the load-balancing
loss's fp32 vector, E each. transformers' experts
at ep = 1 (Qwen3-MoE, Mixtral) run their own code, which keeps the same rows and a few int64
indices per row more or less; the same count stands for them.

Selective checkpointing (fsdp8/parallel/checkpointing.py) keeps every second output of mm and
addmm: of an MoE layer, wq, wv and the router's logits (e E). The grouped GEMMs are not among
those ops, so the experts are recomputed, and with them the dispatch and combine all-to-alls.
Full checkpointing keeps the layer's input. While an MoE layer runs backward, the gradients of
its activations add the experts' output and input rows' (e k 2H) and SwiGLU's three I-wide ones
(e k 3I), or attention's or the norms' when larger, plus the residual's gradient.

Expert parallelism assumes balanced routing: each rank computes T k rows, as many as it sends.

[Note: what a compiled layer keeps]
Under ``ParallelConfig(compile=True)`` Inductor's partitioner chooses what a layer saves and
recomputes the cheap rest in backward. Measured on one H200 (torch 2.11, a world-1 layer at
hidden 4096, 4096 tokens; benchmarks/debug/compiled_layer_probe.py, docs/PLANNING.md), against
the eager count above, which matched those runs to the byte:

- each RMSNorm keeps its input in the compute dtype and its fp32 rsqrt (e dn + 4), not its fp32
  copies (both families);
- SwiGLU's SiLU output is recomputed from the gate's output: the MLP keeps 3 e f, not 4 e f;
- with FP8 linears traced into the graph (every recipe but delayed scaling under TP, which is
  an opaque call there), a linear keeps its input as the block has it, never an FP8 copy
  (fp8/linear.py): no FP8 input bytes. Such a layer kept a further ``2 e dn - kv`` less than
  the same layer in bf16 (at world 1: 15,360 bytes at kv 1024, 12,288 at kv 4096, ffn 8192 and
  14336 alike): the norms' outputs are recomputed into the backward's quantization, and one
  kv-wide byte per token is kept that the count does not attribute. Under TP with sequence
  parallelism the same term, at the norms' dn and the rank's kv, brings the predicted peaks of
  2-GPU FP8 + TP runs to within 0.5% of the measured ones (docs/PLANNING.md); it was fitted
  without TP and checked there, not derived.

Everything else (attention's inputs and outputs, the linears' bf16 inputs, an MoE layer's
routed rows) is kept as in eager layers.

[Note: a mixture of experts beside tensor parallelism]
With tp > 1 (and ep > 1, fsdp8.models.tp_plan.ExpertParallelBlock) attention is split over tp as
in a dense layer, but the router and the experts are not: each tp rank routes and computes its own
tokens with whole weights. Under sequence parallelism those are its T/tp tokens of the tp group's
T, without it all T (every tp rank repeats the experts' work). So per token of the group's
micro-batch, what routing and the experts keep, compute and send is scaled by ``routed_share``
(1/tp or 1); the router's input is the block's input as the rank holds it (H/tp or H per token).
Under sequence parallelism the router's output is also gathered over tp for the load-balancing
loss (fp32, E per token of all T), which keeps none of it (its mean's backward needs the shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .model import ModelSpec, traces_fp8
from .setup import Setup

INDEX_BYTES = 8  # int64 permutations


@dataclass(frozen=True)
class Activations:
    """Bytes per token (of the rank's micro-batch) of one layer, and of the root."""

    saved: float  # kept from forward to backward under the AC mode
    layer_live: float  # one layer's full set, as during its backward (recomputed under AC)
    backward_work: float  # gradients of activations alive inside one layer's backward
    root: float  # final norm and head input, log-softmax output
    loss_forward: float  # beyond ``root`` at the cross-entropy of forward
    loss_backward: float  # beyond ``root`` at the cross-entropy's backward


def expands_kv(spec: ModelSpec) -> bool:
    """Whether the attention repeats K and V to every query head before SDPA."""
    return spec.family == "fsdp8" and spec.kv_heads != spec.heads


def routed_share(setup: Setup) -> float:
    """The share of the tp group's tokens that one tp rank routes through an MoE layer's router and
    experts (see [Note: a mixture of experts beside tensor parallelism])."""
    p = setup.parallel
    return 1 / p.tp if p.sequence_parallel else 1.0


def routed_bytes(spec: ModelSpec, setup: Setup) -> float:
    """What an MoE layer's router and experts keep per token beyond the router's input (see
    [Note: what a mixture-of-experts layer keeps])."""
    e, k, d, i = setup.compute_bytes, spec.experts_per_token, spec.hidden, spec.expert_ffn
    permutations = 4 if setup.parallel.ep > 1 else 2
    router = 4 * spec.experts + (INDEX_BYTES + 4) * k + 4
    return router + e * k * (2 * d + 4 * i + 1) + permutations * INDEX_BYTES * k


def layer_activations(spec: ModelSpec, setup: Setup, fp8: Dict[str, bool]) -> Dict[str, Activations]:
    """``activations`` of each kind of layer the model has (``ModelSpec.layer_kinds``)."""
    return {kind: activations(spec, setup, fp8, kind) for kind, _ in spec.layer_kinds()}


def activations(spec: ModelSpec, setup: Setup, fp8: Dict[str, bool], kind: str = "dense") -> Activations:
    """Per-token activation bytes of a ``kind`` layer (``"dense"``: the Llama block; ``"moe"``: its
    MLP a mixture of experts) under ``setup`` (docs/PLANNING.md derives each term from the tensors
    autograd saves). ``fp8``: which linears are Float8Linear."""
    e, tp = setup.compute_bytes, setup.parallel.tp
    d, q, kv, f, v = spec.hidden, spec.q_dim / tp, spec.kv_dim / tp, spec.ffn / tp, spec.vocab
    dn = d / tp if setup.parallel.sequence_parallel else d  # the residual stream as norms see it
    moe = kind == "moe"
    compiled, traced_fp8 = setup.parallel.compiled, traces_fp8(setup.parallel)
    # RMSNorm: fsdp8's keeps x in fp32 and the normalized fp32 product; transformers' keeps x in
    # fp32 and the normalized value in the compute dtype; both a fp32 rsqrt per token. Compiled:
    # its input and the rsqrt (see [Note: what a compiled layer keeps]).
    norm = (e * dn if compiled else 8 * dn if spec.family == "fsdp8" else (4 + e) * dn) + 4

    def inputs(*names: str, width: float) -> float:
        # A linear saves its input: in the compute dtype, or as FP8 bytes (shared by its siblings);
        # a traced FP8 linear the input itself.
        kinds = {fp8.get(n, False) and not traced_fp8 for n in names}
        return (e * width if False in kinds else 0) + (width if True in kinds else 0)

    # SDPA keeps its inputs: under GQA fsdp8's Llama passes repeat_interleave copies, transformers
    # (no attention mask) the kv heads themselves with enable_gqa. Under context parallelism they
    # are the whole sequence's keys and values, gathered from the cp ranks.
    k_saved = e * (q if expands_kv(spec) else kv) * setup.parallel.cp
    attention = e * q + 2 * k_saved + e * q + 4 * spec.heads / tp  # q, k, v, output, logsumexp
    wo_input = q if fp8.get("wo") and not traced_fp8 else 0  # SDPA keeps the output already; FP8 adds its bytes
    qk_norm = ((4 + e) * (q + kv) + 8) if spec.qk_norm else 0
    share = routed_share(setup)
    if moe:  # the router's input (never FP8), then what routing and the experts keep, for this rank's tokens
        mlp_input, mlp = e * d * share, routed_bytes(spec, setup) * share
    else:  # w1 and w3's input, their outputs, silu (recomputed in a compiled layer), the product
        product = f if fp8.get("w2") and not traced_fp8 else e * f
        mlp_input, mlp = inputs("w1", "w3", width=d), (2 if compiled else 3) * e * f + product
    none = 2 * norm + inputs("wq", "wk", "wv", width=d) + attention + wo_input + qk_norm + mlp_input + mlp
    if traced_fp8 and any(fp8.values()):  # see [Note: what a compiled layer keeps]
        none -= 2 * e * dn - kv
    x_in = e * dn  # the block input, which checkpointing keeps
    if setup.parallel.activation_checkpointing == "full":
        saved = x_in
    elif setup.parallel.activation_checkpointing == "selective":
        saved = x_in + _selective_extra(spec, setup, fp8, moe)
    else:
        saved = none
    if moe:  # the experts' output and input rows' gradients, SwiGLU's three
        mlp_work = e * spec.experts_per_token * (2 * d + 3 * spec.expert_ffn) * share
    else:  # SwiGLU's three F-wide gradients
        mlp_work = 3 * e * f
    # Inside a layer's backward: the MLP's gradients, or attention's dq/dk/dv with FA2's fp32 dq
    # accumulator, or the norms' fp32 temporaries; plus the residual's gradient.
    work = max(mlp_work, (4 + 3 * e) * q, 12 * dn) + 2 * e * d
    # Final norm, head input, log-softmax output (fp32; every vocabulary entry, or this rank's
    # share of them under loss parallelism).
    v_local = v / tp if setup.parallel.loss_parallel else v
    root = norm + e * d + 4 * v_local
    return Activations(saved, none, work, root, loss_forward=(e + 4) * v_local, loss_backward=8 * v_local)


def _selective_extra(spec: ModelSpec, setup: Setup, fp8: Dict[str, bool], moe: bool) -> float:
    """What selective checkpointing keeps beyond the block input: every second matmul's output
    (wq, wv, then w1 and w2, or an MoE layer's router logits: its grouped GEMMs are recomputed),
    SDPA's outputs, reduce-scatter outputs; and FP8 linears' quantized inputs, which the policy
    does not drop (measured on H200: model A, fp8-current, kept 1.7 GiB more than bf16, these
    bytes)."""
    e, tp = setup.compute_bytes, setup.parallel.tp
    d, q, kv, f = spec.hidden, spec.q_dim / tp, spec.kv_dim / tp, spec.ffn / tp
    dn = d / tp if setup.parallel.sequence_parallel else d
    if moe:  # the router's logits for this rank's tokens
        router = spec.experts * routed_share(setup)
        return e * (q + kv + router) + e * q + 4 * spec.heads / tp + (d if fp8.get("wq") else 0) \
            + (q if fp8.get("wo") else 0) + (e * dn if setup.parallel.sequence_parallel else 0)  # wo's reduce-scatter
    saved = e * (q + kv + f + d) + e * q + 4 * spec.heads / tp
    saved += (d if fp8.get("wq") else 0) + (q if fp8.get("wo") else 0) + (d if fp8.get("w1") else 0) \
        + (f if fp8.get("w2") else 0)
    if setup.parallel.sequence_parallel:
        saved += 2 * e * dn
    return saved
