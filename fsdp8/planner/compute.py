"""Compute time of one micro-batch on one rank, recomputation included and collectives not: GEMMs and
attention at fractions of the GPU's peaks, every other kernel at a fraction of HBM bandwidth, for each
kind of decoder layer (dense, mixture of experts) and for the root; and the host's time to issue it.

A mixture-of-experts layer computes its router's GEMM and its experts' grouped GEMMs on k rows per
token (k experts per token: the FLOPs of the active parameters), at the dense GEMM rate; routing
moves rows through HBM (gathering them by expert, weighting and summing them back, and under ep
regrouping what arrived). Its grouped GEMMs are recomputed under selective checkpointing too (see
activations.py [Note: what a mixture-of-experts layer keeps]). Beside tensor parallelism its
attention is split over tp and its router and experts compute whole on the rank's tokens
(activations.py [Note: a mixture of experts beside tensor parallelism]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .activations import expands_kv, routed_share
from .hardware import EP_OPS, MOE_OPS, HostCost, host_model
from .model import ModelSpec, converts_to_fp8, local_shape, traces_fp8
from .setup import Setup


@dataclass(frozen=True)
class LayerCompute:
    """One layer's seconds of GPU work per micro-batch (forward; backward with recomputation), the
    FLOPs it executes, and the host's seconds to issue each pass."""

    fwd: float
    bwd: float
    flops: float
    host_fwd: float
    host_bwd: float


@dataclass(frozen=True)
class Compute:
    """Seconds of one micro-batch's compute on one rank: each kind of layer's (``"dense"``,
    ``"moe"``), the root's (embedding, final norm, head, loss); the FLOPs executed by all of it;
    and the host's time to issue the root's passes (``host.root_fwd``, ``host.root_bwd``)."""

    layers: Dict[str, LayerCompute]
    root_fwd: float
    root_bwd: float
    flops: float
    host: HostCost


def _elementwise_bytes(spec: ModelSpec, setup: Setup, kind: str) -> float:
    """Bytes one layer's forward moves through HBM per token outside GEMMs and attention (eager
    ops: norms in fp32, rotary, the repeat of K and V, residual adds, SwiGLU; an MoE layer's
    SwiGLU on its k rows, the rows gathered by expert, weighted and summed back (6 e k H; 4 more
    under ep, regrouping what arrived and restoring its order), the router's fp32 softmax and
    top-k); backward moves twice that.

    Compiled layers fuse the elementwise ops: each norm reads the residual and the branch's
    output and writes their sum and the normalized value (4 e d), rotary reads and writes q and k
    once, SwiGLU reads the gate and up outputs and writes the product (3 e f, not 5). Measured
    per layer on one H200 (docs/PLANNING.md, "Compiled layers"), with the GEMMs and attention at
    their usual rates: compiled bf16 layers took 0.94-1.03x the predicted forward and backward,
    compiled FP8 layers 0.89-1.26x (each the difference of two short steps)."""
    e, tp = setup.compute_bytes, setup.parallel.tp
    d = spec.hidden / tp if setup.parallel.sequence_parallel else spec.hidden
    q, kv, f = spec.q_dim / tp, spec.kv_dim / tp, spec.ffn / tp
    gqa = 2 * e * (kv + q) if expands_kv(spec) else 0
    compiled = setup.parallel.compiled
    swiglu = 3 if compiled else 5  # per element of the gate: read gate and up, write the product
    if kind == "moe":  # on this tp rank's share of the tokens (activations.routed_share)
        rows = e * spec.experts_per_token
        mlp = (swiglu * rows * spec.expert_ffn + (6 + 4 * (setup.parallel.ep > 1)) * rows * spec.hidden
               + 12 * spec.experts) * routed_share(setup)
    else:
        mlp = swiglu * e * f
    if compiled:  # fused: each norm with the residual add before it, rotary in one pass
        return 8 * e * d + 2 * e * (q + kv) + gqa + mlp
    return 2 * (32 + 2 * e) * d + 9 * e * (q + kv) + gqa + 6 * e * d + mlp


# Matmuls whose outputs selective checkpointing recomputes: every second one of the block
# (wq, wk, wv, wo, w1, w3, w2 in order; parallel/checkpointing.py keeps the odd ones). Of an
# MoE layer, wq, wk, wv, wo and the router: the router's logits are kept, the experts' grouped
# GEMMs (not among the policy's matmuls) recomputed.
_SELECTIVE_RECOMPUTED = ("wk", "wo", "w3")


def _layer(spec: ModelSpec, setup: Setup, kind: str) -> LayerCompute:
    gpu, eff = setup.cluster.gpu, setup.efficiency
    e, tp, ac = setup.compute_bytes, setup.parallel.tp, setup.parallel.activation_checkpointing
    t = setup.micro_batch * setup.seq_len / setup.parallel.cp  # tokens of this rank's micro-batch
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm
    dense = (gpu.bf16_tflops if e == 2 else gpu.fp32_tflops) * 1e12 * eff.gemm
    fp8_rate = gpu.fp8_tflops * 1e12 * eff.fp8_gemm
    moe = kind == "moe"
    gemm, recompute_gemm, quant, mm_flops, recompute_flops, fp8_linears = 0.0, 0.0, 0.0, 0.0, 0.0, 0
    for p in spec.moe_block_params() if moe else spec.block_params():
        if not p.linear:
            continue
        out, inp = local_shape(p, tp, 0)
        flops = 2 * t * out * inp
        fp8 = converts_to_fp8(p, setup.fp8, tp, 0)
        seconds = flops / (fp8_rate if fp8 else dense)
        gemm += seconds
        mm_flops += flops
        if ac == "full" or (ac == "selective" and p.name in _SELECTIVE_RECOMPUTED):
            recompute_gemm += seconds
            recompute_flops += flops
        if fp8:  # quantize x and dy, and transpose both for the weight gradient
            quant += (e + 3) * (out + inp) * t / hbm
            fp8_linears += 1
    if moe:  # whole weights on this tp rank's tokens (t/tp under sequence parallelism, else t)
        routed = t * routed_share(setup)
        router = 2 * routed * spec.experts * spec.hidden
        # gate_up [2I, H] and down [H, I] on each of the token's k rows.
        experts = 2 * routed * spec.experts_per_token * 3 * spec.expert_ffn * spec.hidden
        gemm += (router + experts) / dense
        mm_flops += router + experts
        recomputed = (router if ac == "full" else 0) + (experts if ac != "none" else 0)
        recompute_gemm += recomputed / dense
        recompute_flops += recomputed
    # Causal attention: QK^T and PV over half the score matrix; backward recomputes the
    # scores (5 matmuls to forward's 2).
    attn_flops = 2 * setup.micro_batch * setup.seq_len ** 2 * spec.q_dim / (setup.parallel.cp * tp)
    attn = attn_flops / ((gpu.bf16_tflops if e == 2 else gpu.fp32_tflops) * 1e12 * eff.attention)
    elementwise = _elementwise_bytes(spec, setup, kind) * t / hbm
    recompute = recompute_gemm + (elementwise if ac != "none" else 0.0) + (attn if ac == "full" else 0.0)
    fwd = gemm + attn + elementwise + quant / 3
    bwd = 2 * gemm + 2.5 * attn + 2 * elementwise + 2 * quant / 3 + recompute
    flops = 3 * mm_flops + recompute_flops + 3.5 * attn_flops + (attn_flops if ac == "full" else 0)
    extra_ops = (MOE_OPS + EP_OPS * (setup.parallel.ep > 1)) if moe else 0
    units = 2 if moe and setup.parallel.ep > 1 else 1  # the experts' unit gathers and reduces too
    host = eff.host or host_model(eff, ac, fp8_linears, extra_ops, units, compiled=setup.parallel.compiled,
                                  traced_fp8=traces_fp8(setup.parallel))
    return LayerCompute(fwd, bwd, flops, host.layer_fwd, host.layer_bwd)


def compute(spec: ModelSpec, setup: Setup) -> Compute:
    gpu, eff = setup.cluster.gpu, setup.efficiency
    e, tp, ac = setup.compute_bytes, setup.parallel.tp, setup.parallel.activation_checkpointing
    t = setup.micro_batch * setup.seq_len / setup.parallel.cp  # tokens of this rank's micro-batch
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm
    dense = (gpu.bf16_tflops if e == 2 else gpu.fp32_tflops) * 1e12 * eff.gemm
    layers = {kind: _layer(spec, setup, kind) for kind, _ in spec.layer_kinds()}
    v_local = -(-spec.vocab // tp)
    head = 2 * t * spec.hidden * v_local / dense
    # Logits to fp32, log-softmax and its backward (on this rank's vocabulary under loss parallelism).
    loss = (32 + 2 * e) * (v_local if setup.parallel.loss_parallel else spec.vocab) * t / hbm
    norm = (32 + 2 * e) * spec.hidden * t / hbm
    flops = sum(count * layers[kind].flops for kind, count in spec.layer_kinds()) + 3 * 2 * t * spec.hidden * v_local
    return Compute(layers, root_fwd=head + loss / 3 + norm, root_bwd=2 * head + 2 * loss / 3 + 2 * norm,
                   flops=flops, host=eff.host or host_model(eff, ac, 0))
