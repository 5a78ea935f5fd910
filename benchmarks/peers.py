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
TP stacks (opt-in; T = --tp, default 2; mesh world/T x T, sequence parallel on):
  fsdp8-tp      fsdp8.parallel.tensor_parallel (torch ParallelStyles, torchtitan's layout), then fsdp8 ZeRO-3
                over the data-parallel ranks
  fsdp2-tp      the same TP styles, then torch FSDP2 on the data-parallel sub-mesh
  fsdp8-tp-fp8  fsdp8-tp with FP8 current scaling (sequence gathers in 8 bits)
  torchao-tp-fp8  torchao float8 with its TP styles as torchtitan lays them out, then FSDP2
                (peer_torchao_tp.py; CUDA only: gloo has no float8 all-gather)
  Each with "-compile" (fsdp8-tp-compile, ...): the decoder layers compiled per block as well.
  A TP group's ranks feed one batch (--tp-full-batch: tp micro-batches); tokens/s/GPU counts it once per group.
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
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

# Benchmark the checkout's fsdp8, installed or not.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from peer_stacks import (  # noqa: E402  (after the checkout is on the path)
    ALL_STACKS, BUILDERS, STACKS, Built, Context, _short, mesh_label, optimizer_step, tp_degree, unavailable_reason,
)
import peer_probes  # noqa: E402
from gc_in_step import CollectInStep  # noqa: E402
from peer_report import environment, fmt, print_report, write_json  # noqa: E402

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
    # Host during the timed steps, to tell a slow host from a slow GPU: this process's CPU
    # time (all threads) per step, garbage collections, and the machine's 1-minute load.
    host: dict = field(default_factory=dict)
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


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of a timed run that every peer benchmark takes (peers.py, moe_peers.py)."""
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200 SXM: 989)")
    p.add_argument("--timeout-s", type=int, default=300,
                   help="collective timeout, so a broken stack cannot hang the run")
    p.add_argument("--skip-packed-check", action="store_true", default=True,
                   help="the default: for every stack, replace transformers' per-forward packed-sequence check (a "
                        "device-to-host sync at the start of each forward: py-spy found the host waiting there most "
                        "of a step) by its answer for these batches, which are never packed "
                        "(fsdp8.models.hf_adapter.skip_packed_sequence_check)")
    p.add_argument("--gc-every", type=int, default=0,
                   help="every stack alike: Python's automatic garbage collection off during the timed steps, "
                        "a generation-1 collection on every rank every N steps (gc_in_step.py); 0: "
                        "Python's own collector, each rank pausing at its own moment")
    p.add_argument("--packed-check", dest="skip_packed_check", action="store_false",
                   help="keep transformers' packed-sequence check (one host sync a forward, in every stack)")


def skip_packed_check_if_asked(args: argparse.Namespace) -> None:
    """Every stack alike: the benchmarks' batches are never packed (add_run_arguments)."""
    if args.skip_packed_check:
        from fsdp8.models.hf_adapter import skip_packed_sequence_check

        skip_packed_sequence_check()


def add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """The probes run after the timed steps (probe_and_report), every peer benchmark's."""
    p.add_argument("--profile", default="",
                   help="directory: after timing, profile one more step of each stack and write where its "
                        "GPU time went (fsdp8/app/bench/step_profile.py; rank 0's trace kept as .json.gz)")
    p.add_argument("--profile-top", type=int, default=20, help="kernels listed by --profile, costliest first")
    p.add_argument("--host-profile", default="",
                   help="directory: after timing, run 3 more steps under cProfile and write where the host's time "
                        "went (Python functions by own time; the step is host-bound when the GPU idles)")
    p.add_argument("--host-syncs", default="",
                   help="directory: after timing, run one more step under torch.cuda.set_sync_debug_mode('warn') and "
                        "write, for every rank, each call that made its host wait for the GPU and where it came from")
    p.add_argument("--memory-peak", default="",
                   help="directory: after timing, record one more step's allocations and write what is alive at "
                        "its peak, by where it was allocated (fsdp8/app/bench/memory_peak.py)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", "--model", dest="models", default="A", help="comma list of A, B, tiny")
    p.add_argument("--stacks", default=",".join(STACKS), help="comma list of " + ", ".join(ALL_STACKS))
    add_run_arguments(p)
    p.add_argument("--hsdp-replicate", type=int, default=2,
                   help="replica groups R of the HSDP stacks (mesh R x world/R)")
    p.add_argument("--tp", type=int, default=2,
                   help="tensor-parallel degree of the TP stacks (fsdp8-tp, fsdp2-tp, fsdp8-tp-fp8; sequence parallel "
                        "on): a (world/T data-parallel) x (T tensor-parallel) mesh, TP groups of neighbouring ranks")
    p.add_argument("--tp-full-batch", action="store_true",
                   help="feed each tensor-parallel group tp times the model's micro-batch, so that each GPU of a TP "
                        "stack has the tokens of a GPU of the dp stacks (a like-for-like TP cost); default: a TP "
                        "group trains one micro-batch")
    p.add_argument("--async-tp", action="store_true",
                   help="compiled TP stacks: torch's micro-pipelined TP (Inductor's _micro_pipeline_tp, symmetric "
                        "memory on the tp group), which splits a sequence-parallel all-gather or reduce-scatter "
                        "and the matmul beside it into overlapped pieces")
    add_probe_arguments(p)
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile's mode for every compiled stack's layers (e.g. reduce-overhead: CUDA graphs, "
                        "each step marked with cudagraph_mark_step_begin)")
    p.add_argument("--inductor", default="",
                   help="comma list of torch._inductor.config settings for every compiled stack, e.g. "
                        "triton.tile_reductions=1 (values 0/1 are booleans, others ints or strings)")
    p.add_argument("--loopback-world", type=int, default=0,
                   help="N > 1: one process plays rank 0 of a world of N with loopback collectives "
                        "(fsdp8/app/bench/loopback.py): the world-N step minus communication, on one device")
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
        from fsdp8.app.bench import loopback

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


def group_rows(spec: ModelSpec, ctx: Context, tp: int = 1) -> int:
    """Sequences a data-parallel rank (a tensor-parallel group of ``tp`` ranks) trains per step:
    the model's micro-batch, or with --tp-full-batch tp times it, so that each GPU of a TP stack
    has a dp stack GPU's share of tokens."""
    return spec.micro_batch * (tp if getattr(ctx.args, "tp_full_batch", False) else 1)


def make_batches(spec: ModelSpec, n: int, ctx: Context, tp: int = 1) -> list[torch.Tensor]:
    """Random token ids: a fixed stream per data-parallel rank (the ranks of a tensor-parallel
    group, consecutive, share one), identical for every stack."""
    gen = torch.Generator().manual_seed(ctx.args.seed * 1_000_003 + ctx.rank // tp)
    shape = (group_rows(spec, ctx, tp), spec.seq)
    return [torch.randint(0, spec.vocab, shape, generator=gen).to(ctx.device) for _ in range(n)]


def flops_per_token(spec: ModelSpec, n_params: int) -> int:
    return 6 * n_params + 12 * spec.layers * spec.hidden * spec.seq


# ----------------------------------------------------------------------------- measuring


def train_step(built: Built, batch: torch.Tensor, ctx: Context) -> torch.Tensor:
    if ctx.args.compile_mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()  # a new step: CUDA graphs may reuse last step's outputs
    loss = built.model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer_step(built, ctx)
    built.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_steps(built: Built, batches: list[torch.Tensor], ctx: Context) -> tuple[list[torch.Tensor], list[float], float, dict]:
    """Warmup then timed steps: (losses of all steps, timed per-step ms, mean wall ms of timed
    steps, the host's figures over the timed steps)."""
    warmup = ctx.args.warmup
    losses = [train_step(built, b, ctx) for b in batches[:warmup]]
    cuda = ctx.device.type == "cuda"
    with CollectInStep(ctx.args.gc_every) as collector:  # its first full collection before the barrier
        _sync(ctx)
        dist.barrier()
        wall0, cpu0, gc0 = time.perf_counter(), time.process_time(), _gc_collections()
        marks = []
        for batch in batches[warmup:]:
            start = _mark(cuda)
            losses.append(train_step(built, batch, ctx))
            collector.step()
            marks.append((start, _mark(cuda)))
        _sync(ctx)
        wall_ms = (time.perf_counter() - wall0) * 1e3 / len(marks)
        host = {"cpu_ms_per_step": round((time.process_time() - cpu0) * 1e3 / len(marks), 2),
                "gc_collections": _gc_collections() - gc0, "loadavg_1min": round(os.getloadavg()[0], 2)}
    step_ms = [s.elapsed_time(e) if cuda else (e - s) * 1e3 for s, e in marks]
    return losses, step_ms, wall_ms, host


def _gc_collections() -> int:
    return sum(generation["collections"] for generation in gc.get_stats())


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


def record_steps(built: Built, batches: list[torch.Tensor], ctx: Context, result: Result, tokens_per_gpu: float) -> None:
    """Train and time ``batches`` (run_steps) and fill ``result``: the ranks' mean losses, the
    slowest rank's median step, tokens/s per GPU (``tokens_per_gpu`` a step), MFU and peaks."""
    losses, step_ms, wall_ms, result.host = run_steps(built, batches, ctx)
    mean_losses = [x / ctx.world for x in _all_reduce([x.item() for x in losses], dist.ReduceOp.SUM, ctx)]
    result.losses = [round(x, 5) for x in mean_losses]
    result.loss_first, result.loss_last = mean_losses[0], mean_losses[-1]
    median, wall = _all_reduce([statistics.median(step_ms), wall_ms], dist.ReduceOp.MAX, ctx)
    result.step_ms_median, result.step_ms_mean_wall = median, wall
    result.step_ms_all = [round(x, 3) for x in step_ms]
    result.tokens_per_s_per_gpu = tokens_per_gpu / (median / 1e3)
    if ctx.device.type == "cuda":
        result.mfu = result.tokens_per_s_per_gpu * result.flops_per_token / (ctx.args.peak_tflops * 1e12)
        peaks = [torch.cuda.max_memory_allocated(ctx.device), torch.cuda.max_memory_reserved(ctx.device)]
        result.peak_alloc_gib, result.peak_reserved_gib = (x / GIB for x in _all_reduce(peaks, dist.ReduceOp.MAX, ctx))


def measure(spec: ModelSpec, stack: str, ctx: Context, result: Result) -> None:
    """Build, train and time one stack on one model; fill `result`."""
    tp = tp_degree(stack, ctx)
    batches = make_batches(spec, ctx.args.warmup + ctx.args.steps, ctx, tp)
    model = build_hf_model(spec, ctx.device, ctx.args.seed)
    result.n_params = sum(p.numel() for p in model.parameters())
    result.flops_per_token = flops_per_token(spec, result.n_params)
    built = BUILDERS[stack](model, ctx)
    del model
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)  # peak of training, not of the full-model init

    # A TP group shares its batch.
    record_steps(built, batches, ctx, result, tokens_per_gpu=group_rows(spec, ctx, tp) * spec.seq / tp)
    probe_and_report(built, batches[-1], f"{spec.name}-{stack}", f"{stack}, model {spec.name}", ctx, result)


def probe_and_report(built: Built, batch: torch.Tensor, stem: str, label: str, ctx: Context, result: Result) -> None:
    """After the timed steps: the probes the arguments ask for (peer_probes.py; extra steps, not in
    the timings), then the model's memory report and the stack's notes into ``result``."""
    def step():
        return train_step(built, batch, ctx)

    if ctx.args.profile and ctx.device.type == "cuda":
        peer_probes.profile_one_step(step, ctx.args.profile, stem, label, ctx)
    if ctx.args.host_profile:
        peer_probes.host_profile(step, ctx.args.host_profile, stem, label, ctx)
    if ctx.args.host_syncs and ctx.device.type == "cuda":
        peer_probes.host_syncs(step, ctx.args.host_syncs, stem, label, ctx)
    if ctx.args.memory_peak and ctx.device.type == "cuda":
        peer_probes.memory_peak_of_step(step, ctx.args.memory_peak, stem, label, ctx)
    report = getattr(built.model, "memory_report", None)
    if callable(report):
        result.memory_report = str(report())
    result.note = "; ".join(built.notes)


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
    return guarded_run(result, unavailable_reason(stack, ctx), lambda: measure(spec, stack, ctx, result), ctx,
                       f"[peers] {stack} on model {spec.name}")


def guarded_run(result: Result, reason: str | None, measure_stack: Callable[[], None], ctx: Context,
                what: str) -> Result:
    """``measure_stack()`` filling ``result``, unless ``reason`` says why the stack cannot run here
    (then "skipped"); a failure is reported and recorded ("failed"), and the next stack runs. The
    stack's memory is released and every rank waits for the others after it."""
    if reason is not None:
        result.status, result.note = "skipped", reason
        return result
    # Each stack compiles afresh: Dynamo's cache is per code object, so a stack compiling the
    # same decoder-layer forward at another model's shapes would otherwise get (and time) a
    # recompiled dynamic-shape graph.
    torch._dynamo.reset()
    try:
        measure_stack()
    except Exception as err:  # report and go on with the next stack
        result.status, result.note, result.error = "failed", _short(err), traceback.format_exc()
        if ctx.rank == 0:
            print(f"{what} failed:\n{result.error}", file=sys.stderr, flush=True)
    left = release(ctx)
    if left > LEAK_WARN_BYTES:
        result.note = "; ".join(filter(None, [result.note, f"{left / GIB:.2f} GiB still allocated after teardown"]))
    dist.barrier()
    return result


def inductor_settings(text: str) -> dict:
    """"a.b=1,c=x" -> {"a.b": True, "c": "x"}: Inductor config keys and values."""
    settings = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--inductor takes key=value items, got {item!r}")
        settings[key.strip()] = {"0": False, "1": True}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    return settings


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = init_process_group(args)
    skip_packed_check_if_asked(args)
    if args.inductor:
        torch._inductor.config.load_config(inductor_settings(args.inductor))
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
                      f"{fmt(result.tokens_per_s_per_gpu, ',.0f')} tok/s/GPU, "
                      f"peak {fmt(result.peak_alloc_gib, '.2f')} GiB {result.note}"
                      f"{'; host ' + json.dumps(result.host) if result.host else ''}", flush=True)
                write_json(args.out, env, orders, results, complete=False)
    results.sort(key=lambda r: args.models.index(r.model))
    if ctx.rank == 0:
        print_report(env, orders, results)
        write_json(args.out, env, orders, results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
