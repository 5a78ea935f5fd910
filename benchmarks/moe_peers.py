"""Train a Qwen3-MoE-shaped model with fsdp8 and its peers side by side and print a table.

Stacks (--stacks; run each in its own process for a per-stack peak: ``gpu_run.py moe``):
  fsdp8-ep        fsdp8.parallelize(HF Qwen3MoeForCausalLM, ParallelConfig(ep=E, compile=True)):
                  experts split over E ranks (all-to-all dispatch), sharded over the rest; bf16
  fsdp8-ep-fp8    the same with fp8=Float8CurrentScaling(): dense linears and expert GEMMs in FP8,
                  weights (experts included) all-gathered in 8 bits
  fsdp8-ep-fp8-e4m3   the same with Float8CurrentScaling(fp8_format="e4m3"): e4m3 gradients too, so the
                  expert GEMMs' backward also runs as one grouped kernel on Hopper
  fsdp8-ep-fp8-block  the same with Float8BlockScaling() (1x128 / 128x128 blocks)
  fsdp8           ep 1: every rank computes every expert for its own tokens, experts sharded
  fsdp8-fp8-e4m3  ep 1 with Float8CurrentScaling(fp8_format="e4m3")
  fsdp8-fp8-delayed  ep 1 with DelayedScaling(): per-expert amax histories (the experts run outside
                  the compiled graphs; e5m2 gradients keep their backward group by group)
  fsdp8-fp8-delayed-e4m3  the same with DelayedScaling(fp8_format="e4m3"): the backward in the grouped
                  kernel too
  fsdp2           torch FSDP2 per decoder layer over the same HF model (no expert parallelism:
                  experts sharded and gathered like dense weights), experts as transformers'
                  grouped_mm, layers compiled
  torchtitan-ep   torchtitan's own Qwen3 MoE (PyPI torchtitan 0.2.x) with its expert parallelism
                  and FSDP2, compiled as torchtitan compiles it; CUDA only (its token permutation
                  is a Triton kernel)
Every stack: bf16 compute weights, fp32 main weights and gradient reduction, AdamW, the same
random token ids per data-parallel rank, no auxiliary router loss (torchtitan's is an
optimizer-side bias update, switched off here), causal SDPA attention.

Model "Q" (2 GPUs): hidden 2048, 8 layers, 16 heads of 128 (4 KV heads), 64 experts of 768,
top 8, vocab 32000, 2 sequences of 2048 per GPU. FLOPs/token count active parameters:
6 * (non-expert parameters + layers * top_k * 3 * hidden * expert_ffn) + 12 * L * H * S.

Model "W": model Q's attention with 16 experts of 2048 per layer (top 8; 1.83 B parameters, 1.02 B
active), for FP8 experts where the GEMMs weigh more.

On 2 GPUs, one stack:
    torchrun --nproc_per_node 2 benchmarks/moe_peers.py --model Q --stacks fsdp8-ep --out runs/moe.json
CPU smoke test (gloo):
    torchrun --nproc_per_node 2 benchmarks/moe_peers.py --model tiny --device cpu --stacks fsdp8-ep,fsdp2 \\
        --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_report import environment, fmt, markdown_table, write_json  # noqa: E402
from peer_stacks import Built, Context, _compile_layers, build_fsdp2, plain_optimizer  # noqa: E402
from peers import (  # noqa: E402
    Result, add_probe_arguments, add_run_arguments, guarded_run, init_process_group, make_batches, probe_and_report,
    record_steps, skip_packed_check_if_asked,
)

import fsdp8  # noqa: E402  (the checkout, which peers.py put on the path)


@dataclass(frozen=True)
class MoeSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    seq: int
    micro_batch: int

    def params(self, experts: int) -> int:
        """Parameters of the model with ``experts`` experts per layer (every stack's model is this
        shape: embedding, untied head, q/k norms, router, experts)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q * 2 + h * kv * 2 + 2 * self.head_dim
        layer = attention + 2 * h + self.experts * h + experts * 3 * h * self.expert_ffn
        return 2 * self.vocab * h + self.layers * layer + h

    @property
    def active_params(self) -> int:
        """Parameters one token uses: its top_k experts of each layer, and all the rest."""
        return self.params(self.top_k)


MODELS = {
    "Q": MoeSpec("Q", 2048, 8, 16, 4, 128, 64, 8, 768, 32000, 2048, 2),
    # Fewer, wider experts (16 of 2048, top-8): four times Q's rows per expert, GEMMs a larger share.
    "W": MoeSpec("W", 2048, 8, 16, 4, 128, 16, 8, 2048, 32000, 2048, 2),
    "tiny": MoeSpec("tiny", 64, 2, 4, 2, 16, 8, 2, 32, 256, 64, 2),
}
FLOPS_FORMULA = "FLOPs/token = 6*N_active + 12*L*H*S (N_active: parameters a token uses, experts top_k of E)"


# ----------------------------------------------------------------------------- models


def build_hf_moe(spec: MoeSpec, device: torch.device, seed: int) -> nn.Module:
    """HF Qwen3MoeForCausalLM in fp32, the same on every rank; experts as transformers' grouped_mm."""
    import transformers

    fields = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=4 * spec.hidden,
                  moe_intermediate_size=spec.expert_ffn, num_experts=spec.experts, num_experts_per_tok=spec.top_k,
                  norm_topk_prob=True, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, max_position_embeddings=spec.seq,
                  output_router_logits=False, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    try:
        config = transformers.Qwen3MoeConfig(experts_implementation="grouped_mm", **fields)
    except (TypeError, ValueError):  # a transformers without selectable expert kernels
        config = transformers.Qwen3MoeConfig(**fields)
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.Qwen3MoeForCausalLM(config)


class TorchtitanLM(nn.Module):
    """torchtitan's decoder (tokens -> logits) behind the HF call the timing loop makes:
    ``model(input_ids=..., labels=...).loss``, labels shifted as HF shifts them."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        logits = self.decoder(input_ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return type("Output", (), {"loss": loss})


def _import_torchtitan():
    """torchtitan's model and parallelize modules. Its package imports the HF ``datasets`` loader at
    the top (for its data pipeline, unused here); where ``datasets`` is not installed an empty
    stand-in lets the import through."""
    import importlib.util
    import types

    if importlib.util.find_spec("datasets") is None:
        for name in ("datasets", "datasets.distributed"):
            stub = types.ModuleType(name)
            stub.Dataset = stub.IterableDataset = object
            stub.load_dataset = stub.split_dataset_by_node = None
            sys.modules.setdefault(name, stub)
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    return JobConfig, ParallelDims, MoEArgs, parallelize_qwen3, Qwen3ModelArgs, Qwen3Model


# ----------------------------------------------------------------------------- stacks


def build_fsdp8(spec: MoeSpec, ctx: Context, ep: int, recipe=None, fp8_dispatch: bool = False) -> Built:
    model = build_hf_moe(spec, ctx.device, ctx.args.seed)
    config = fsdp8.ParallelConfig(ep=ep, fp8=recipe, compile=ctx.device.type == "cuda", fp8_dispatch=fp8_dispatch,
                                  precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return plain_optimizer(fsdp8.parallelize(model, config), ctx)


def build_fsdp2_moe(spec: MoeSpec, ctx: Context) -> Built:
    model = build_hf_moe(spec, ctx.device, ctx.args.seed)
    built = build_fsdp2(model, ctx)
    if ctx.device.type == "cuda":
        _compile_layers(built.model, ctx)
    return built


def build_torchtitan(spec: MoeSpec, ctx: Context, ep: int) -> Built:
    JobConfig, ParallelDims, MoEArgs, parallelize_qwen3, Qwen3ModelArgs, Qwen3Model = _import_torchtitan()
    args = Qwen3ModelArgs(
        vocab_size=spec.vocab, max_seq_len=spec.seq, head_dim=spec.head_dim, dim=spec.hidden, n_layers=spec.layers,
        n_heads=spec.heads, n_kv_heads=spec.kv_heads, qk_norm=True, hidden_dim=4 * spec.hidden, moe_enabled=True,
        moe_inter_dim=spec.expert_ffn, attn_type="sdpa",
        moe_args=MoEArgs(num_experts=spec.experts, num_shared_experts=0, top_k=spec.top_k, score_func="softmax",
                         route_norm=True, score_before_experts=False, load_balance_coeff=None))
    job = JobConfig()
    job.training.seq_len = spec.seq
    job.training.mixed_precision_param, job.training.mixed_precision_reduce = "bfloat16", "float32"
    job.parallelism.data_parallel_shard_degree = ctx.world
    job.parallelism.expert_parallel_degree = ep
    job.compile.enable = ctx.device.type == "cuda"
    job.compile.components = ["model"]
    dims = ParallelDims(dp_replicate=1, dp_shard=ctx.world, cp=1, tp=1, pp=1, ep=ep, etp=1, world_size=ctx.world)
    dims.build_mesh()
    with torch.device("meta"):
        decoder = Qwen3Model(args)
    decoder = parallelize_qwen3(decoder, dims, job)
    decoder.to_empty(device=ctx.device)
    torch.manual_seed(ctx.args.seed)
    with torch.no_grad():
        decoder.init_weights(buffer_device=ctx.device)
    return plain_optimizer(TorchtitanLM(decoder.train()), ctx)


# Each stack: (spec, ctx) -> Built; the -ep stacks split the experts over --ep ranks.
BUILDERS: Dict[str, Callable[[MoeSpec, Context], Built]] = {
    "fsdp8-ep": lambda spec, ctx: build_fsdp8(spec, ctx, ctx.args.ep),
    "fsdp8-ep-fp8": lambda spec, ctx: build_fsdp8(spec, ctx, ctx.args.ep, fsdp8.Float8CurrentScaling()),
    "fsdp8-ep-fp8-e4m3": lambda spec, ctx: build_fsdp8(spec, ctx, ctx.args.ep,
                                                      fsdp8.Float8CurrentScaling(fp8_format="e4m3")),
    "fsdp8-ep-fp8-block": lambda spec, ctx: build_fsdp8(spec, ctx, ctx.args.ep, fsdp8.Float8BlockScaling()),
    # Tokens dispatched to their experts as FP8 bytes and 1x128 scales (ParallelConfig(fp8_dispatch=True)).
    "fsdp8-ep-fp8dispatch": lambda spec, ctx: build_fsdp8(spec, ctx, ctx.args.ep, fp8_dispatch=True),
    "fsdp8-ep-fp8-e4m3-fp8dispatch": lambda spec, ctx: build_fsdp8(
        spec, ctx, ctx.args.ep, fsdp8.Float8CurrentScaling(fp8_format="e4m3"), fp8_dispatch=True),
    "fsdp8": lambda spec, ctx: build_fsdp8(spec, ctx, 1),
    "fsdp8-fp8-e4m3": lambda spec, ctx: build_fsdp8(spec, ctx, 1, fsdp8.Float8CurrentScaling(fp8_format="e4m3")),
    "fsdp8-fp8-delayed": lambda spec, ctx: build_fsdp8(spec, ctx, 1, fsdp8.DelayedScaling()),
    "fsdp8-fp8-delayed-e4m3": lambda spec, ctx: build_fsdp8(spec, ctx, 1, fsdp8.DelayedScaling(fp8_format="e4m3")),
    "fsdp2": build_fsdp2_moe,
    "torchtitan-ep": lambda spec, ctx: build_torchtitan(spec, ctx, ctx.args.ep),
}


def unavailable(stack: str, ctx: Context):
    """None when the stack can run here, else why not."""
    if stack == "torchtitan-ep":
        import importlib.util

        if ctx.device.type != "cuda":
            return "CUDA only (torchtitan permutes tokens with a Triton kernel)"
        if importlib.util.find_spec("torchtitan") is None:
            return "torchtitan is not installed (pip install torchtitan==0.2.2)"
    return None


def expert_parallel(stack: str, ctx: Context) -> int:
    return ctx.args.ep if "-ep" in stack else 1


# ----------------------------------------------------------------------------- measuring


def measure(spec: MoeSpec, stack: str, ctx: Context, result: Result) -> None:
    batches = make_batches(spec, ctx.args.warmup + ctx.args.steps, ctx)  # a rank's own stream, as peers.py's
    built = BUILDERS[stack](spec, ctx)
    gc.collect()
    result.n_params = spec.params(spec.experts)
    result.flops_per_token = 6 * spec.active_params + 12 * spec.layers * spec.hidden * spec.seq
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    record_steps(built, batches, ctx, result, tokens_per_gpu=spec.micro_batch * spec.seq)
    probe_and_report(built, batches[-1], f"{spec.name}-{stack}", f"{stack}, model {spec.name}", ctx, result)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Q", choices=sorted(MODELS))
    p.add_argument("--stacks", default="fsdp8-ep,fsdp8-ep-fp8,fsdp2,torchtitan-ep",
                   help="comma list of " + ", ".join(BUILDERS))
    p.add_argument("--ep", type=int, default=0, help="expert-parallel degree of the -ep stacks (default: the world)")
    add_run_arguments(p)
    add_probe_arguments(p)
    p.add_argument("--out", default="runs/moe.json")
    args = p.parse_args(argv)
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    unknown = [s for s in args.stacks if s not in BUILDERS]
    if unknown or not args.stacks:
        p.error(f"unknown or no stacks {unknown}; choose from {', '.join(BUILDERS)}")
    # What peers.py's helpers read from the arguments.
    args.compile_mode, args.loopback_world, args.hsdp_replicate, args.tp = None, 0, 1, 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = init_process_group(args)
    skip_packed_check_if_asked(args)
    args.ep = args.ep or ctx.world
    spec = MODELS[args.model]
    env = environment(ctx) if ctx.rank == 0 else None
    if env is not None:
        env.update(flops_formula=FLOPS_FORMULA, model=spec.__dict__, ep=args.ep)
    results = []
    for stack in args.stacks:
        result = Result(model=spec.name, stack=stack, status="ok", mesh=f"{ctx.world} (ep {expert_parallel(stack, ctx)})")
        results.append(guarded_run(result, unavailable(stack, ctx), lambda: measure(spec, stack, ctx, result), ctx,
                                   f"[moe] {stack}"))
        if ctx.rank == 0:
            print(f"[moe] {stack}: {result.status} {fmt(result.tokens_per_s_per_gpu, ',.0f')} tok/s/GPU, peak "
                  f"{fmt(result.peak_alloc_gib, '.2f')} GiB {result.note}; host {json.dumps(result.host)}", flush=True)
            write_json(args.out, env, {spec.name: args.stacks}, results, complete=False)
    if ctx.rank == 0:
        print(f"\n## MoE peers: {ctx.world} x {env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
              f"model {spec.name}, ep {args.ep}\n- {FLOPS_FORMULA}\n")
        print(markdown_table(results))
        write_json(args.out, env, {spec.name: args.stacks}, results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
