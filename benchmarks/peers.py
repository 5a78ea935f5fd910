"""Train HF LlamaForCausalLM with several FSDP stacks side by side and print a table.

All stacks run one after the other in ONE torchrun process group, on the same
model (same seed, fp32 init), the same random token ids and the same AdamW, so
their first-step losses should agree to bf16 rounding. Each stack is built,
warmed up, timed and fully torn down before the next one, so peak memory is
per stack.

Stacks (--stacks, default all; one that cannot run is listed with the reason):
  fsdp8     fsdp8.fully_shard, strategy "optim_grads_params" (ZeRO-3)
  fsdp2     torch.distributed.fsdp.fully_shard per decoder layer, then the root
  megatron  megatron_fsdp.fully_shard_model + fully_shard_optimizer (ZeRO-3),
            PyPI package megatron-fsdp, CUDA only
HSDP stacks (opt-in; R = --hsdp-replicate, default 2; mesh R x world/R):
  fsdp8-hsdp-noshard  fsdp8 ZeRO-3 inside each shard group, gradients all-reduced across
                      the R replicas (outer_strategy "no_shard")
  fsdp8-hsdp-optim    the same, main weights and optimizer state also sharded across
                      replicas (outer_strategy "optim")
  fsdp2-hsdp          torch FSDP2 fully_shard on a 2-D ("replicate", "shard") mesh
  They are skipped (with the reason) where world % R != 0 or R == world (shard groups of 1).
All use bf16 compute weights, fp32 gradient reduction and fp32 main weights.

On 2 GPUs:
    torchrun --nproc_per_node 2 benchmarks/peers.py --models A,B --out runs/peers.json
HSDP 2x2 against flat ZeRO-3 on 4 GPUs:
    torchrun --nproc_per_node 4 benchmarks/peers.py --models B \
        --stacks fsdp8,fsdp2,fsdp8-hsdp-noshard,fsdp8-hsdp-optim,fsdp2-hsdp
CPU smoke test (gloo; memory and MFU columns are n/a):
    torchrun --nproc_per_node 2 benchmarks/peers.py --model tiny --device cpu \
        --stacks fsdp2 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

# Benchmark the checkout's fsdp8, installed or not.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

STACKS = ("fsdp8", "fsdp2", "megatron")
# FP8 stacks (recipes native on Hopper), run with --stacks; see build_fsdp8_fp8 / build_torchao.
FP8_STACKS = ("fsdp8-fp8-current-compile-keep-min1024", "fsdp8-fp8-current-compile-keep-max2048", "fsdp8-fp8-current", "fsdp8-fp8-delayed", "fsdp8-fp8-block", "fsdp8-fp8-mxfp8",
              "fsdp8-fp8-current-primary", "fsdp8-compile", "fsdp8-fp8-current-compile", "fsdp8-fp8-delayed-compile",
              "fsdp8-fp8-block-compile", "fsdp8-fp8-mxfp8-compile", "torchao", "torchao-compile")
# HSDP stacks: a (replicate, shard) mesh of --hsdp-replicate x world/R ranks; see hsdp_mesh_shape.
HSDP_STACKS = ("fsdp8-hsdp-noshard", "fsdp8-hsdp-optim", "fsdp2-hsdp")
# fsdp8's one call (fsdp8.parallelize: units and plan found by itself) and CPU offload, run with --stacks.
MANAGER_STACKS = ("fsdp8-parallelize", "fsdp8-parallelize-compile", "fsdp8-offload")
# FSDP2 as torchtitan applies it (the last layer kept gathered from forward into backward).
PEER_VARIANTS = ("fsdp2-keep-last",)
ALL_STACKS = STACKS + FP8_STACKS + HSDP_STACKS + MANAGER_STACKS + PEER_VARIANTS
FLOPS_FORMULA = (
    "FLOPs/token = 6*N + 12*L*H*S (N = all parameters incl. embedding and lm_head, L layers, H hidden, S seq)"
)
GIB = 1024**3
LEAK_WARN_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    micro_batch: int


MODELS = {
    "A": ModelSpec("A", 2048, 8192, 16, 16, 8, 32000, 2048, 4),
    "B": ModelSpec("B", 4096, 14336, 8, 32, 8, 32000, 2048, 2),
    "tiny": ModelSpec("tiny", 64, 256, 2, 4, 2, 1024, 64, 2),
}


@dataclass
class Context:
    """What every stack needs to know about the run."""

    args: argparse.Namespace
    device: torch.device
    rank: int
    world: int
    mesh: object = None
    megatron_mesh: object = None
    hsdp_meshes: dict = field(default_factory=dict)  # "fsdp8" / "fsdp2" -> 2-D mesh, built once


@dataclass
class Built:
    """A sharded model and its optimizer, as one stack made them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    notes: list[str] = field(default_factory=list)
    fused_unverified: bool = False
    after_step: object = None  # called after each optimizer step (torchao's scale precompute)


@dataclass
class Result:
    model: str
    stack: str
    status: str  # "ok" | "skipped" | "failed"
    note: str = ""
    mesh: str = ""  # data-parallel mesh: "4" (1-D) or "2x2" (replicate x shard, HSDP)
    n_params: int = 0
    flops_per_token: int = 0
    tokens_per_s_per_gpu: float | None = None
    step_ms_median: float | None = None
    step_ms_mean_wall: float | None = None
    mfu: float | None = None
    peak_alloc_gib: float | None = None
    peak_reserved_gib: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    losses: list[float] = field(default_factory=list)  # every step, mean over ranks
    step_ms_all: list[float] = field(default_factory=list)
    memory_report: str | None = None
    error: str | None = None


# ----------------------------------------------------------------------------- setup


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", "--model", dest="models", default="A", help="comma list of A, B, tiny")
    p.add_argument("--stacks", default=",".join(STACKS), help="comma list of " + ", ".join(ALL_STACKS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200 SXM: 989)")
    p.add_argument("--timeout-s", type=int, default=300,
                   help="collective timeout, so a broken stack cannot hang the run")
    p.add_argument("--hsdp-replicate", type=int, default=2,
                   help="replica groups R of the HSDP stacks (mesh R x world/R)")
    p.add_argument("--profile", default="",
                   help="directory: after timing, profile one more step of each stack and write where its "
                        "GPU time went (benchmarks/step_profile.py; rank 0's trace kept as .json.gz)")
    p.add_argument("--skip-packed-check", action="store_true",
                   help="for every stack, replace transformers' per-forward packed-sequence check (a device-to-host "
                        "sync at the start of each forward: py-spy found the host waiting there most of a step) by "
                        "its answer for these unpacked batches (fsdp8.parallel.hf.skip_packed_sequence_check)")
    p.add_argument("--host-profile", default="",
                   help="directory: after timing, run 3 more steps under cProfile and write where the host's time "
                        "went (Python functions by own time; the step is host-bound when the GPU idles)")
    p.add_argument("--memory-peak", default="",
                   help="directory: after timing, record one more step's allocations and write what is alive at "
                        "its peak, by where it was allocated (benchmarks/memory_peak.py)")
    p.add_argument("--loopback-world", type=int, default=0,
                   help="N > 1: one process plays rank 0 of a world of N with loopback collectives "
                        "(benchmarks/loopback.py): the world-N step minus communication, on one device")
    p.add_argument("--out", default="runs/peers.json",
                   help="JSON results file (rank 0 rewrites it after every stack, so a timeout keeps what ran)")
    args = p.parse_args(argv)
    args.models = _split(args.models, MODELS)
    args.stacks = _split(args.stacks, ALL_STACKS)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.loopback_world and (args.loopback_world < 2 or int(os.environ.get("WORLD_SIZE", 1)) != 1):
        p.error("--loopback-world takes N >= 2 and runs in one process (plain python, or torchrun --nproc_per_node 1)")
    return args


def _split(text: str, allowed) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"unknown or empty names {unknown or text!r}; choose from {', '.join(allowed)}")
    return names


def init_process_group(args) -> Context:
    """torchrun env -> process group (nccl on cuda, gloo on cpu; the loopback group with
    --loopback-world) and a 1-D world mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = timedelta(seconds=args.timeout_s)
    if args.loopback_world:  # the group exists before the branches below, which then only pick the device
        import loopback

        rank, world = 0, args.loopback_world
        loopback.init_loopback(world)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    ctx = Context(args=args, device=device, rank=rank, world=world)
    ctx.mesh = init_device_mesh(device.type, (world,))
    return ctx


def build_hf_model(spec: ModelSpec, device: torch.device, seed: int) -> torch.nn.Module:
    """The same fp32 LlamaForCausalLM on every rank and for every stack."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.seq, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise RuntimeError(f"expected an fp32 model, got parameter dtypes {dtypes}")
    return model


def make_batches(spec: ModelSpec, n: int, ctx: Context) -> list[torch.Tensor]:
    """Random token ids: a fixed stream per rank, identical for every stack."""
    gen = torch.Generator().manual_seed(ctx.args.seed * 1_000_003 + ctx.rank)
    shape = (spec.micro_batch, spec.seq)
    return [torch.randint(0, spec.vocab, shape, generator=gen).to(ctx.device) for _ in range(n)]


def flops_per_token(spec: ModelSpec, n_params: int) -> int:
    return 6 * n_params + 12 * spec.layers * spec.hidden * spec.seq


def decoder_layer_cls():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


# ----------------------------------------------------------------------------- optimizer


def make_adamw(params, ctx: Context, fused: bool) -> torch.optim.Optimizer:
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=ctx.args.lr, **kind)


def wants_fused(ctx: Context) -> bool:
    return ctx.device.type == "cuda"


def optimizer_step(built: Built, ctx: Context) -> None:
    """optimizer.step(); the first fused step that fails on DTensors falls back to foreach."""
    if not built.fused_unverified:
        built.optimizer.step()
        if built.after_step is not None:
            built.after_step()
        return
    built.fused_unverified = False
    try:
        built.optimizer.step()
    except (RuntimeError, NotImplementedError, TypeError) as err:
        params = [p for group in built.optimizer.param_groups for p in group["params"]]
        built.optimizer = make_adamw(params, ctx, fused=False)
        built.notes.append(f"fused AdamW failed ({_short(err)}); foreach used")
        built.optimizer.step()
    if built.after_step is not None:
        built.after_step()


def plain_optimizer(model: torch.nn.Module, ctx: Context) -> Built:
    fused = wants_fused(ctx)
    return Built(model, make_adamw(model.parameters(), ctx, fused), fused_unverified=fused)


# ----------------------------------------------------------------------------- stacks


def hsdp_mesh_shape(world: int, replicate: int) -> tuple[int, int]:
    """(R, S) of the HSDP mesh: R replicas of S-rank shard groups; ValueError saying why not."""
    if replicate < 2:
        raise ValueError(f"--hsdp-replicate {replicate} < 2: one replica is flat FSDP, not HSDP")
    if world % replicate:
        raise ValueError(f"world size {world} is not divisible by --hsdp-replicate {replicate}")
    if world == replicate:
        raise ValueError(f"--hsdp-replicate {replicate} at world size {world} leaves shard groups of one rank "
                         f"(a {replicate}x1 mesh is pure replication); HSDP needs world >= {2 * replicate}")
    return replicate, world // replicate


def mesh_label(stack: str, ctx: Context) -> str:
    """The data-parallel mesh a stack runs on: "W" (1-D) or "RxS" (HSDP, replicate x shard)."""
    if stack in HSDP_STACKS:
        try:
            return "x".join(map(str, hsdp_mesh_shape(ctx.world, ctx.args.hsdp_replicate)))
        except ValueError:
            return ""
    return str(ctx.world)


def unavailable_reason(stack: str, ctx: Context) -> str | None:
    """None when the stack can run here, else why not."""
    if stack in HSDP_STACKS:
        try:
            hsdp_mesh_shape(ctx.world, ctx.args.hsdp_replicate)
        except ValueError as err:
            return str(err)
        return unavailable_reason("fsdp2" if stack == "fsdp2-hsdp" else "fsdp8", ctx)
    if stack.startswith("fsdp8-"):
        return unavailable_reason("fsdp8", ctx)
    if stack.startswith("torchao"):
        try:
            import torchao.float8  # noqa: F401
        except Exception as err:
            return f"torchao.float8 not importable: {_short(err)}"
        return None
    if stack == "fsdp8":
        try:
            import fsdp8
        except Exception as err:  # the engine is optional for this script
            return f"fsdp8 not importable: {_short(err)}"
        missing = [n for n in ("init_distributed", "fully_shard", "Precision") if not hasattr(fsdp8, n)]
        return f"fsdp8 lacks {', '.join(missing)}" if missing else None
    if stack in ("fsdp2", "fsdp2-keep-last"):
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
        except ImportError as err:
            return f"torch FSDP2 not importable: {_short(err)}"
        return None
    if stack == "megatron":
        if ctx.device.type != "cuda":
            return "megatron-fsdp needs CUDA (it creates torch.cuda streams)"
        try:
            import megatron_fsdp  # noqa: F401
        except Exception as err:
            return f"megatron_fsdp not importable: {_short(err)}"
        return None
    raise ValueError(stack)


def build_fsdp8(model: torch.nn.Module, ctx: Context, mesh=None, outer_strategy: str = "no_shard") -> Built:
    import fsdp8

    fsdp8.init_distributed()
    model = fsdp8.fully_shard(
        model,
        mesh=mesh if mesh is not None else ctx.mesh,
        units=[decoder_layer_cls()],
        strategy="optim_grads_params",
        outer_strategy=outer_strategy,
        precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    return plain_optimizer(model, ctx)


def build_fsdp8_parallelize(model: torch.nn.Module, ctx: Context, compile_units: bool = False) -> Built:
    """fsdp8.parallelize with what a user passes for bf16 ZeRO-3 on this world: no units, no plan."""
    import fsdp8

    config = fsdp8.ParallelConfig(precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                                  compile=compile_units)
    return plain_optimizer(fsdp8.parallelize(model, config), ctx)


def build_fsdp8_offload(model: torch.nn.Module, ctx: Context) -> Built:
    """fsdp8 ZeRO-3 with main weights, gradients and AdamW state in pinned host memory; the
    optimizer steps on the CPU (foreach: torch's fused AdamW is for GPU tensors)."""
    import fsdp8

    model = fsdp8.fully_shard(model, mesh=ctx.mesh, units=[decoder_layer_cls()], offload="optim",
                              precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return Built(model, make_adamw(model.parameters(), ctx, fused=False))


def build_fsdp2(model: torch.nn.Module, ctx: Context, mesh=None, keep_last: bool = False) -> Built:
    """torch FSDP2 per decoder layer and at the root. ``keep_last``: the last layer is not
    resharded after forward (backward starts with it), as torchtitan shards Llama."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = ctx.mesh if mesh is None else mesh
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=not (keep_last and i == len(layers) - 1))
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return plain_optimizer(model, ctx)


def hsdp_mesh(ctx: Context, kind: str):
    """The 2-D HSDP mesh, made once per run: fsdp8.make_mesh(dp_replicate=R) for fsdp8 (dims
    "dp_replicate", "dp_shard"), init_device_mesh with dims ("replicate", "shard") for FSDP2.
    Both are row-major: ranks r*S .. r*S+S-1 form shard group r."""
    if kind not in ctx.hsdp_meshes:
        replicate, shard = hsdp_mesh_shape(ctx.world, ctx.args.hsdp_replicate)
        if kind == "fsdp8":
            import fsdp8

            mesh = fsdp8.make_mesh(dp_replicate=replicate)
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(ctx.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
        if mesh.device_type != ctx.device.type or tuple(mesh.shape) != (replicate, shard):
            raise RuntimeError(f"{kind} HSDP mesh is {mesh.device_type} {tuple(mesh.shape)}, "
                               f"expected {ctx.device.type} {(replicate, shard)}")
        ctx.hsdp_meshes[kind] = mesh
    return ctx.hsdp_meshes[kind]


def build_fsdp8_hsdp(model: torch.nn.Module, ctx: Context, outer_strategy: str) -> Built:
    return build_fsdp8(model, ctx, mesh=hsdp_mesh(ctx, "fsdp8"), outer_strategy=outer_strategy)


def build_fsdp2_hsdp(model: torch.nn.Module, ctx: Context) -> Built:
    return build_fsdp2(model, ctx, mesh=hsdp_mesh(ctx, "fsdp2"))


def build_megatron(model: torch.nn.Module, ctx: Context) -> Built:
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    if ctx.megatron_mesh is None:
        # megatron-fsdp wants named (dp_shard, tp) dims; one mesh for all models.
        ctx.megatron_mesh = init_device_mesh("cuda", (ctx.world, 1), mesh_dim_names=("fsdp", "tp"))
    _bf16_params_with_fp32_main_init(model)
    model = megatron_fsdp.fully_shard_model(
        model,
        device_mesh=ctx.megatron_mesh,
        dp_shard_dim="fsdp",
        tp_dim="tp",
        fsdp_unit_modules=[decoder_layer_cls()],
        zero_dp_strategy="optim_grads_params",
        device=ctx.device,
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32
        ),
    )
    notes = ["optimizer pre-stepped once with zero grads by fully_shard_optimizer"]
    try:
        optimizer = megatron_fsdp.fully_shard_optimizer(make_adamw(model.parameters(), ctx, wants_fused(ctx)))
    except (RuntimeError, NotImplementedError, TypeError) as err:
        if not wants_fused(ctx):
            raise
        notes.append(f"fused AdamW failed ({_short(err)}); foreach used")
        optimizer = megatron_fsdp.fully_shard_optimizer(make_adamw(model.parameters(), ctx, fused=False))
    return Built(model, optimizer, notes)


def _bf16_params_with_fp32_main_init(model: torch.nn.Module) -> None:
    """Cast parameters (not buffers) to bf16, keeping their fp32 values for the main weights.

    Megatron-FSDP computes in the model's own parameter dtype and fills its fp32
    main-weight buffer from the parameters. Without this its fp32 masters would
    start from bf16-rounded values, unlike the other stacks. It reads the exact
    init through the `get_high_precision_init_val` hook it offers for
    TransformerEngine FP8 parameters. RoPE buffers stay fp32, as under FSDP2.
    """
    for param in model.parameters():
        fp32 = param.detach().clone()
        param.data = param.data.to(torch.bfloat16)
        param.get_high_precision_init_val = lambda fp32=fp32: fp32
        param.clear_high_precision_init_val = lambda p=param: _drop_init_hooks(p)


def _drop_init_hooks(param: torch.nn.Parameter) -> None:
    del param.get_high_precision_init_val
    del param.clear_high_precision_init_val


def _compile_layers(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer's forward (fsdp8's hooks stay outside, in __call__;
    Float8Linear calls are opaque breaks, everything between them is fused)."""
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward)


def build_fsdp8_compiled(model: torch.nn.Module, ctx: Context) -> Built:
    built = build_fsdp8(model, ctx)
    _compile_layers(built.model)
    return built


# Shape rules for which linears stay in bf16 (issue 17: small projections where FP8 may not
# pay), as fp8_filter(name, linear) -> convert?; stacks "...-keep-<rule>".
FP8_KEEP_RULES = {
    "min1024": lambda name, m: min(m.in_features, m.out_features) > 1024,  # K/V projections of A and B
    "max2048": lambda name, m: max(m.in_features, m.out_features) > 2048,  # all of A's attention
}


def build_fsdp8_fp8(model: torch.nn.Module, ctx: Context, recipe_name: str, primary: bool = False,
                    compile_blocks: bool = False, keep: Optional[str] = None) -> Built:
    """fsdp8 ZeRO-3 with FP8 GEMMs and 8-bit weight all-gathers in the decoder layers (those
    ``FP8_KEEP_RULES[keep]`` leaves in bf16 excepted)."""
    import fsdp8
    from fsdp8.fp8.convert import fp8_friendly
    from fsdp8.fp8.recipes import recipe_from_name

    fsdp8.init_distributed()
    recipe = recipe_from_name(recipe_name)
    if primary:  # FP8 primary weights: packed FP8 shards refreshed once per step
        for layer in model.model.layers:
            fsdp8.convert_to_fp8(layer, recipe)
            for module in layer.modules():
                if isinstance(module, fsdp8.Float8Linear):
                    fsdp8.fp8.convert.make_fp8_primary(module, recipe)
    model = fsdp8.fully_shard(
        model,
        mesh=ctx.mesh,
        units=[decoder_layer_cls()],
        strategy="optim_grads_params",
        precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        fp8=recipe,
        fp8_filter=None if keep is None else lambda n, m: fp8_friendly(n, m) and FP8_KEEP_RULES[keep](n, m),
    )
    if compile_blocks:
        _compile_layers(model)
    return plain_optimizer(model, ctx)


def build_torchao(model: torch.nn.Module, ctx: Context, compile_blocks: bool) -> Built:
    """torch FSDP2 + torchao float8 (tensorwise, FP8 all-gather, scales precomputed after each
    step), decoder layers compiled per block as torchtitan does."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: "layers" in fqn)
    layers = model.model.layers
    if compile_blocks:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=ctx.mesh, mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    built = plain_optimizer(model, ctx)
    built.after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)
    return built


BUILDERS = {
    "fsdp8": build_fsdp8,
    "fsdp2": build_fsdp2,
    "fsdp2-keep-last": lambda m, c: build_fsdp2(m, c, keep_last=True),
    "megatron": build_megatron,
    "fsdp8-fp8-current": lambda m, c: build_fsdp8_fp8(m, c, "fp8-current"),
    "fsdp8-fp8-delayed": lambda m, c: build_fsdp8_fp8(m, c, "fp8-delayed"),
    "fsdp8-fp8-block": lambda m, c: build_fsdp8_fp8(m, c, "fp8-block"),
    "fsdp8-fp8-mxfp8": lambda m, c: build_fsdp8_fp8(m, c, "fp8-mxfp8"),
    "fsdp8-fp8-current-primary": lambda m, c: build_fsdp8_fp8(m, c, "fp8-current", primary=True),
    "fsdp8-compile": build_fsdp8_compiled,
    "fsdp8-fp8-current-compile": lambda m, c: build_fsdp8_fp8(m, c, "fp8-current", compile_blocks=True),
    "fsdp8-fp8-delayed-compile": lambda m, c: build_fsdp8_fp8(m, c, "fp8-delayed", compile_blocks=True),
    "fsdp8-fp8-block-compile": lambda m, c: build_fsdp8_fp8(m, c, "fp8-block", compile_blocks=True),
    "fsdp8-fp8-mxfp8-compile": lambda m, c: build_fsdp8_fp8(m, c, "fp8-mxfp8", compile_blocks=True),
    **{f"fsdp8-fp8-current-compile-keep-{rule}": functools.partial(build_fsdp8_fp8, recipe_name="fp8-current",
                                                                    compile_blocks=True, keep=rule)
       for rule in FP8_KEEP_RULES},
    "torchao": lambda m, c: build_torchao(m, c, compile_blocks=False),
    "torchao-compile": lambda m, c: build_torchao(m, c, compile_blocks=True),
    "fsdp8-hsdp-noshard": lambda m, c: build_fsdp8_hsdp(m, c, "no_shard"),
    "fsdp8-hsdp-optim": lambda m, c: build_fsdp8_hsdp(m, c, "optim"),
    "fsdp2-hsdp": build_fsdp2_hsdp,
    "fsdp8-parallelize": build_fsdp8_parallelize,
    "fsdp8-parallelize-compile": lambda m, c: build_fsdp8_parallelize(m, c, compile_units=True),
    "fsdp8-offload": build_fsdp8_offload,
}


# ----------------------------------------------------------------------------- measuring


def train_step(built: Built, batch: torch.Tensor, ctx: Context) -> torch.Tensor:
    loss = built.model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer_step(built, ctx)
    built.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_steps(built: Built, batches: list[torch.Tensor], ctx: Context) -> tuple[list[torch.Tensor], list[float], float]:
    """Warmup then timed steps: (losses of all steps, timed per-step ms, mean wall ms of timed steps)."""
    warmup = ctx.args.warmup
    losses = [train_step(built, b, ctx) for b in batches[:warmup]]
    cuda = ctx.device.type == "cuda"
    _sync(ctx)
    dist.barrier()
    wall0 = time.perf_counter()
    marks = []
    for batch in batches[warmup:]:
        start = _mark(cuda)
        losses.append(train_step(built, batch, ctx))
        marks.append((start, _mark(cuda)))
    _sync(ctx)
    wall_ms = (time.perf_counter() - wall0) * 1e3 / len(marks)
    step_ms = [s.elapsed_time(e) if cuda else (e - s) * 1e3 for s, e in marks]
    return losses, step_ms, wall_ms


def _mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _sync(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _all_reduce(values: list[float], op, ctx: Context) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def measure(spec: ModelSpec, stack: str, ctx: Context, result: Result) -> None:
    """Build, train and time one stack on one model; fill `result`."""
    batches = make_batches(spec, ctx.args.warmup + ctx.args.steps, ctx)
    model = build_hf_model(spec, ctx.device, ctx.args.seed)
    result.n_params = sum(p.numel() for p in model.parameters())
    result.flops_per_token = flops_per_token(spec, result.n_params)
    built = BUILDERS[stack](model, ctx)
    del model
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)  # peak of training, not of the full-model init

    losses, step_ms, wall_ms = run_steps(built, batches, ctx)

    mean_losses = [x / ctx.world for x in _all_reduce([x.item() for x in losses], dist.ReduceOp.SUM, ctx)]
    result.losses = [round(x, 5) for x in mean_losses]
    result.loss_first, result.loss_last = mean_losses[0], mean_losses[-1]
    median, wall = _all_reduce([statistics.median(step_ms), wall_ms], dist.ReduceOp.MAX, ctx)
    result.step_ms_median, result.step_ms_mean_wall = median, wall
    result.step_ms_all = [round(x, 3) for x in step_ms]
    result.tokens_per_s_per_gpu = spec.micro_batch * spec.seq / (median / 1e3)
    if ctx.device.type == "cuda":
        result.mfu = result.tokens_per_s_per_gpu * result.flops_per_token / (ctx.args.peak_tflops * 1e12)
        peaks = [torch.cuda.max_memory_allocated(ctx.device), torch.cuda.max_memory_reserved(ctx.device)]
        result.peak_alloc_gib, result.peak_reserved_gib = (x / GIB for x in _all_reduce(peaks, dist.ReduceOp.MAX, ctx))
    if ctx.args.profile and ctx.device.type == "cuda":
        profile_one_step(spec, stack, built, batches[-1], ctx)
    if ctx.args.host_profile:
        host_profile(spec, stack, built, batches[-1], ctx)
    if ctx.args.memory_peak and ctx.device.type == "cuda":
        memory_peak_of_step(spec, stack, built, batches[-1], ctx)
    report = getattr(built.model, "memory_report", None)
    if callable(report):
        result.memory_report = str(report())
    result.note = "; ".join(built.notes)


def host_profile(spec: ModelSpec, stack: str, built: Built, batch: torch.Tensor, ctx: Context, steps: int = 3) -> None:
    """Three extra steps under cProfile (not in the timings): the Python functions that spend
    the host's time, by own time and by cumulative time, rank 0's."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        train_step(built, batch, ctx)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    if ctx.rank != 0:
        return
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    out = Path(ctx.args.host_profile)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{spec.name}-{stack}-host.txt").write_text(f"{stack}, model {spec.name}, {steps} steps\n" + text.getvalue())


def profile_one_step(spec: ModelSpec, stack: str, built: Built, batch: torch.Tensor, ctx: Context) -> None:
    """One extra, profiled step (not in the timings): compute / exposed communication / idle."""
    from step_profile import format_summary, profile_step, summarize

    out = Path(ctx.args.profile)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{spec.name}-{stack}-rank{ctx.rank}"
    kernels = profile_step(lambda: train_step(built, batch, ctx),
                           trace_path=str(base) + ".json.gz" if ctx.rank == 0 else None)
    text = format_summary(f"{stack}, model {spec.name}, rank {ctx.rank} of {ctx.world}", summarize(kernels))
    base.with_suffix(".md").write_text(text + "\n")
    if ctx.rank == 0:
        print(text, flush=True)


def memory_peak_of_step(spec: ModelSpec, stack: str, built: Built, batch: torch.Tensor, ctx: Context) -> None:
    """One extra step with the allocator's history recorded: what is alive at its peak."""
    from memory_peak import format_peak, live_at_peak, record_step

    events, baseline = record_step(lambda: train_step(built, batch, ctx))
    peak, live = live_at_peak(events, baseline)
    text = format_peak(f"{stack}, model {spec.name}, rank {ctx.rank} of {ctx.world}", peak, live, baseline)
    out = Path(ctx.args.memory_peak)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{spec.name}-{stack}-rank{ctx.rank}.md").write_text(text + "\n")
    if ctx.rank == 0:
        print(text, flush=True)


def release(ctx: Context) -> int:
    """Free what the last stack left; returns bytes still allocated on this device."""
    gc.collect()
    if ctx.device.type != "cuda":
        return 0
    torch.cuda.synchronize(ctx.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def run_stack(spec: ModelSpec, stack: str, ctx: Context) -> Result:
    result = Result(model=spec.name, stack=stack, status="ok", mesh=mesh_label(stack, ctx))
    reason = unavailable_reason(stack, ctx)
    if reason is not None:
        result.status, result.note = "skipped", reason
        return result
    # Each stack compiles afresh: Dynamo's cache is per code object, so a stack compiling the
    # same decoder-layer forward at another model's shapes would otherwise get (and time) a
    # recompiled dynamic-shape graph.
    torch._dynamo.reset()
    try:
        measure(spec, stack, ctx, result)
    except Exception as err:  # report and go on with the next stack
        result.status, result.note, result.error = "failed", _short(err), traceback.format_exc()
        if ctx.rank == 0:
            print(f"[peers] {stack} on model {spec.name} failed:\n{result.error}", file=sys.stderr, flush=True)
    left = release(ctx)
    if left > LEAK_WARN_BYTES:
        result.note = "; ".join(filter(None, [result.note, f"{left / GIB:.2f} GiB still allocated after teardown"]))
    dist.barrier()
    return result


# ----------------------------------------------------------------------------- reporting


def _short(err: BaseException, limit: int = 160) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def environment(ctx: Context) -> dict:
    import transformers

    env = {
        "world_size": ctx.world,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_tflops": ctx.args.peak_tflops,
        "flops_formula": FLOPS_FORMULA,
        "timing": ("CUDA events per step, median; max over ranks" if ctx.device.type == "cuda"
                   else "perf_counter per step, median; max over ranks"),
        "memory": "torch.cuda.max_memory_{allocated,reserved} over warmup+timed steps, max over ranks",
        "warmup": ctx.args.warmup,
        "steps": ctx.args.steps,
        "hsdp_replicate": ctx.args.hsdp_replicate,
        "loopback": bool(ctx.args.loopback_world),
    }
    try:
        import megatron_fsdp

        env["megatron_fsdp"] = megatron_fsdp.__version__
    except Exception:
        env["megatron_fsdp"] = None
    return env


def markdown_table(results: list[Result]) -> str:
    head = ("| model | stack | mesh | tokens/s/GPU | step ms (median) | MFU | peak alloc GiB | peak reserved GiB "
            "| loss step 1 | loss last | notes |")
    rows = [head, "|" + "---|" * 11]
    for r in results:
        mfu = None if r.mfu is None else 100 * r.mfu
        note = r.note if r.status == "ok" else f"{r.status.upper()}: {r.note}"
        rows.append(
            f"| {r.model} | {r.stack} | {r.mesh or 'n/a'} | {_fmt(r.tokens_per_s_per_gpu, ',.0f')} "
            f"| {_fmt(r.step_ms_median, '.1f')} "
            f"| {_fmt(mfu, '.1f')}{'%' if mfu is not None else ''} | {_fmt(r.peak_alloc_gib, '.2f')} "
            f"| {_fmt(r.peak_reserved_gib, '.2f')} | {_fmt(r.loss_first, '.4f')} | {_fmt(r.loss_last, '.4f')} "
            f"| {note} |"
        )
    return "\n".join(rows)


def print_report(env: dict, orders: dict, results: list[Result]) -> None:
    print(f"\n## peers: {env['world_size']} x {env['device']}, torch {env['torch']}, "
          f"transformers {env['transformers']}, megatron-fsdp {env['megatron_fsdp'] or 'not installed'}")
    print(f"- {env['flops_formula']}; MFU = tokens/s/GPU * FLOPs/token / ({env['peak_tflops']:g} TFLOP/s)")
    print(f"- timing: {env['timing']}, {env['warmup']} warmup + {env['steps']} timed steps")
    print(f"- memory: {env['memory']}")
    print(f"- mesh: data-parallel ranks; RxS = HSDP, R replicas of S-rank shard groups (--hsdp-replicate {env['hsdp_replicate']})")
    if env.get("loopback"):
        print(f"- LOOPBACK: one process plays rank 0 of {env['world_size']} on one device; collectives are local "
              "copies (benchmarks/loopback.py): the world's step minus communication; losses are not a real model's")
    for model, order in orders.items():
        print(f"- run order: each stack over all models, stacks in turn: {' -> '.join(order)} (model {model})")
    print()
    print(markdown_table(results))
    for r in results:
        if r.memory_report:
            print(f"\n### {r.stack} memory_report, model {r.model}\n{r.memory_report}")
    sys.stdout.flush()


def write_json(path: str, env: dict, orders: dict, results: list[Result], complete: bool = True) -> None:
    """Write the results; `complete` is False for the partial files written after each stack."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "stack_order": orders, "complete": complete,
               "results": [asdict(r) for r in results]}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)  # a reader (or a timeout) never sees half a file
    if complete:
        print(f"\nwrote {out}")


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = init_process_group(args)
    if args.skip_packed_check:  # every stack alike: the batches here are never packed
        from fsdp8.parallel.hf import skip_packed_sequence_check

        skip_packed_sequence_check()
    results = []
    orders = {name: list(args.stacks) for name in args.models}
    env = environment(ctx) if ctx.rank == 0 else None
    # Stack-major: memory a stack fails to free after teardown only weighs on its own later runs.
    for stack in args.stacks:
        for name in args.models:
            if ctx.rank == 0:
                print(f"[peers] model {name}: {stack} ...", flush=True)
            result = run_stack(MODELS[name], stack, ctx)
            results.append(result)
            if ctx.rank == 0:  # partial results survive a timeout: printed, and in the JSON
                print(f"[peers] {name} {stack} (mesh {result.mesh or 'n/a'}): {result.status} "
                      f"{_fmt(result.tokens_per_s_per_gpu, ',.0f')} tok/s/GPU, "
                      f"peak {_fmt(result.peak_alloc_gib, '.2f')} GiB {result.note}", flush=True)
                write_json(args.out, env, orders, results, complete=False)
    results.sort(key=lambda r: args.models.index(r.model))
    if ctx.rank == 0:
        print_report(env, orders, results)
        write_json(args.out, env, orders, results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
