"""The stacks of benchmarks/peers.py: how each one shards the model and makes its optimizer.

Each builder takes the unsharded HF model and the run's Context and returns a Built: the
sharded model and its AdamW (fused on GPUs, with a foreach fallback for a stack whose fused
step fails on its parameters). peers.py times them; nothing here measures."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

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
# Tensor parallelism (--tp T, sequence parallel on) x data parallelism over world/T: both stacks
# split the layers with the same torch ParallelStyles (fsdp8.parallel.tensor_parallel's plan, torchtitan's
# Megatron layout), then shard over the data-parallel ranks with fsdp8 or with torch FSDP2.
TP_STACKS = ("fsdp8-tp", "fsdp2-tp", "fsdp8-tp-fp8", "torchao-tp-fp8",
             "fsdp8-tp-compile", "fsdp2-tp-compile", "fsdp8-tp-fp8-compile", "torchao-tp-fp8-compile",
             "fsdp8-tp-fp8-block-compile")
# Every compiled TP stack compiles with static shapes, as fsdp8.parallelize does under TP on torch
# < 2.13: torch 2.11's DTensor cannot hash a symbolic shape (pytorch#185190), which a recompiled
# layer with DTensor inputs from a graph break then hits. The same setting for the peers keeps
# the comparison even.
TP_COMPILE_DYNAMIC = False
ALL_STACKS = STACKS + FP8_STACKS + HSDP_STACKS + MANAGER_STACKS + PEER_VARIANTS + TP_STACKS


@dataclass
class Context:
    """What every stack needs to know about the run."""

    args: argparse.Namespace
    device: torch.device
    rank: int
    world: int
    mesh: object = None
    megatron_mesh: object = None
    meshes: dict = field(default_factory=dict)  # "fsdp8" / "fsdp2" (HSDP), "tp" -> 2-D mesh, built once


@dataclass
class Built:
    """A sharded model and its optimizer, as one stack made them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    notes: list[str] = field(default_factory=list)
    fused_unverified: bool = False
    after_step: object = None  # called after each optimizer step (torchao's scale precompute)


def decoder_layer_cls():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _short(err: BaseException, limit: int = 160) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def tp_degree(stack: str, ctx: Context) -> int:
    return ctx.args.tp if stack in TP_STACKS else 1


def mesh_label(stack: str, ctx: Context) -> str:
    """The mesh a stack runs on: "W" (1-D), "RxS" (HSDP, replicate x shard) or "D dp x T tp"."""
    if stack in TP_STACKS:
        return f"{ctx.world // ctx.args.tp} dp x {ctx.args.tp} tp" if not ctx.world % ctx.args.tp else ""
    if stack in HSDP_STACKS:
        try:
            return "x".join(map(str, hsdp_mesh_shape(ctx.world, ctx.args.hsdp_replicate)))
        except ValueError:
            return ""
    return str(ctx.world)


def unavailable_reason(stack: str, ctx: Context) -> str | None:
    """None when the stack can run here, else why not."""
    if stack in TP_STACKS:
        tp = ctx.args.tp
        if tp < 2 or ctx.world % tp:
            return f"--tp {tp} must be >= 2 and divide the world of {ctx.world} ranks"
        if stack.startswith("torchao-tp-fp8"):
            if ctx.device.type != "cuda":  # measured: "RuntimeError: Invalid scalar type" from gloo
                return "gloo cannot all-gather float8 tensors (torchao's FP8 sequence gathers); CUDA only"
            return unavailable_reason("torchao", ctx) or unavailable_reason("fsdp2", ctx)
        return unavailable_reason("fsdp2" if stack.startswith("fsdp2") else "fsdp8", ctx)
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


def build_fsdp8(model: torch.nn.Module, ctx: Context, mesh=None, outer_strategy: str = "no_shard",
                recipe_name: Optional[str] = None, fp8_filter=None) -> Built:
    """fsdp8 ZeRO-3 per decoder layer, bf16 compute and fp32 reduction (with ``recipe_name``: the
    layers' linears in FP8, those ``fp8_filter`` accepts)."""
    import fsdp8
    from fsdp8.fp8.recipes import recipe_from_name

    fsdp8.init_distributed()
    model = fsdp8.fully_shard(
        model,
        mesh=mesh if mesh is not None else ctx.mesh,
        units=[decoder_layer_cls()],
        strategy="optim_grads_params",
        outer_strategy=outer_strategy,
        precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        fp8=recipe_from_name(recipe_name) if recipe_name else None,
        fp8_filter=fp8_filter,
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


def _tp_mesh(ctx: Context):
    """The (dp_shard, tp) mesh of the TP stacks, made once per run."""
    import fsdp8

    fsdp8.init_distributed()
    if "tp" not in ctx.meshes:
        ctx.meshes["tp"] = fsdp8.make_mesh(dp_shard=ctx.world // ctx.args.tp, tp=ctx.args.tp)
        if getattr(ctx.args, "async_tp", False):
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            enable_symm_mem_for_group(ctx.meshes["tp"]["tp"].get_group().group_name)
            torch._inductor.config._micro_pipeline_tp = True
    return ctx.meshes["tp"]


def build_fsdp8_tp(model: torch.nn.Module, ctx: Context, recipe_name: Optional[str] = None,
                   compile_blocks: bool = False) -> Built:
    """fsdp8.parallel.tensor_parallel (sequence parallel), then fsdp8 ZeRO-3 over the data-parallel ranks
    of the 2-D mesh (with ``recipe_name``: FP8 linears, their sequence gathers in 8 bits)."""
    from fsdp8.parallel.tp import tensor_parallel

    mesh = _tp_mesh(ctx)
    model = tensor_parallel(model, mesh["tp"], sequence_parallel=True)
    built = build_fsdp8(model, ctx, mesh=mesh, recipe_name=recipe_name)
    if compile_blocks:
        _compile_layers(built.model, ctx, dynamic=TP_COMPILE_DYNAMIC)
    return built


def build_fsdp2_tp(model: torch.nn.Module, ctx: Context, compile_blocks: bool = False) -> Built:
    """The same torch TP styles, then torch FSDP2 on the data-parallel sub-mesh (2-D FSDP2 x TP,
    last layer kept for backward as torchtitan does)."""
    from fsdp8.parallel.tp import tensor_parallel

    mesh = _tp_mesh(ctx)
    model = tensor_parallel(model, mesh["tp"], sequence_parallel=True)
    built = build_fsdp2(model, ctx, mesh=mesh["dp_shard"], keep_last=True)
    if compile_blocks:
        _compile_layers(built.model, ctx, dynamic=TP_COMPILE_DYNAMIC)
    return built


def build_torchao_tp(model: torch.nn.Module, ctx: Context, compile_blocks: bool = False) -> Built:
    """torchao float8 with its TP styles (torchtitan's layout, peer_torchao_tp.py), then torch
    FSDP2 on the data-parallel sub-mesh; scales precomputed after each step. Compiled as
    torchtitan orders it: TP, then each block compiled, then FSDP2."""
    from peer_torchao_tp import apply_torchao_tp
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    mesh = _tp_mesh(ctx)
    model = apply_torchao_tp(model, mesh["tp"])
    if compile_blocks:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, mode=ctx.args.compile_mode, dynamic=TP_COMPILE_DYNAMIC)
    built = build_fsdp2(model, ctx, mesh=mesh["dp_shard"], keep_last=True)
    built.after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)
    return built


def hsdp_mesh(ctx: Context, kind: str):
    """The 2-D HSDP mesh, made once per run: fsdp8.make_mesh(dp_replicate=R) for fsdp8 (dims
    "dp_replicate", "dp_shard"), init_device_mesh with dims ("replicate", "shard") for FSDP2.
    Both are row-major: ranks r*S .. r*S+S-1 form shard group r."""
    if kind not in ctx.meshes:
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
        ctx.meshes[kind] = mesh
    return ctx.meshes[kind]


def build_fsdp8_hsdp(model: torch.nn.Module, ctx: Context, outer_strategy: str) -> Built:
    return build_fsdp8(model, ctx, mesh=hsdp_mesh(ctx, "fsdp8"), outer_strategy=outer_strategy)


def build_fsdp2_hsdp(model: torch.nn.Module, ctx: Context) -> Built:
    return build_fsdp2(model, ctx, mesh=hsdp_mesh(ctx, "fsdp2"))


def build_megatron(model: torch.nn.Module, ctx: Context) -> Built:
    from peer_megatron import build_megatron_fsdp  # the package imports only where the stack runs

    return build_megatron_fsdp(model, ctx)


def _compile_layers(model: torch.nn.Module, ctx: Context, dynamic: Optional[bool] = None) -> None:
    """torch.compile each decoder layer's forward (fsdp8's hooks stay outside, in __call__;
    Float8Linear calls are opaque breaks, everything between them is fused), in the mode
    --compile-mode names. The TP stacks pass ``dynamic=False`` (see TP_COMPILE_DYNAMIC)."""
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, mode=ctx.args.compile_mode, dynamic=dynamic)



def build_fsdp8_compiled(model: torch.nn.Module, ctx: Context) -> Built:
    built = build_fsdp8(model, ctx)
    _compile_layers(built.model, ctx)
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
    from fsdp8.fp8.convert import fp8_friendly, make_fp8_primary
    from fsdp8.fp8.linear import Float8Linear
    from fsdp8.fp8.recipes import recipe_from_name

    if primary:  # FP8 primary weights: packed FP8 shards refreshed once per step
        recipe = recipe_from_name(recipe_name)
        for layer in model.model.layers:
            fsdp8.convert_to_fp8(layer, recipe)
            for module in layer.modules():
                if isinstance(module, Float8Linear):
                    make_fp8_primary(module, recipe)
    keep_bf16 = None if keep is None else lambda n, m: fp8_friendly(n, m) and FP8_KEEP_RULES[keep](n, m)
    built = build_fsdp8(model, ctx, recipe_name=recipe_name, fp8_filter=keep_bf16)
    if compile_blocks:
        _compile_layers(built.model, ctx)
    return built


def build_torchao(model: torch.nn.Module, ctx: Context, compile_blocks: bool) -> Built:
    """torch FSDP2 + torchao float8 (tensorwise, FP8 all-gather, scales precomputed after each
    step), decoder layers compiled per block as torchtitan does."""
    from peer_torchao_tp import convert_torchao
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    convert_torchao(model)
    layers = model.model.layers
    if compile_blocks:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, mode=ctx.args.compile_mode)
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
    "fsdp8-tp": build_fsdp8_tp,
    "fsdp2-tp": build_fsdp2_tp,
    "fsdp8-tp-fp8": lambda m, c: build_fsdp8_tp(m, c, "fp8-current"),
    "torchao-tp-fp8": build_torchao_tp,
    "fsdp8-tp-compile": lambda m, c: build_fsdp8_tp(m, c, compile_blocks=True),
    "fsdp2-tp-compile": lambda m, c: build_fsdp2_tp(m, c, compile_blocks=True),
    "fsdp8-tp-fp8-compile": lambda m, c: build_fsdp8_tp(m, c, "fp8-current", compile_blocks=True),
    "fsdp8-tp-fp8-block-compile": lambda m, c: build_fsdp8_tp(m, c, "fp8-block", compile_blocks=True),
    "torchao-tp-fp8-compile": lambda m, c: build_torchao_tp(m, c, compile_blocks=True),
}
