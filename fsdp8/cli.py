"""The ``fsdp8`` command line: ``fsdp8 train`` (the main job), ``fsdp8 export``, ``fsdp8 plan``
(predict memory, communication and speed) and ``fsdp8 bench`` (measure beside the prediction).

Everything that can be checked before a worker starts is checked here, in the launching
process, and reported in one line: flags, the checkpoint to resume, the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import warnings
from typing import List, Optional

from . import __version__
from .checkpoint import export, verify
from .checkpoint.exporter import EXPORT_FILES, describe_files, held_files
from .checkpoint.store import CheckpointError, DamagedCheckpointError, complete_checkpoints
from .bench import PRECISIONS as BENCH_PRECISIONS, BenchConfig, bench
from .config import AC_MODES, STRATEGY_NAMES
from .fp8.convert import HighPrecisionLayerWarning
from .launch import launch, resolve_nproc, under_torchrun
from .models.llama import PRESETS
from .planner import plan, search
from .planner.candidates import fixes
from .planner.hardware import GPUS, gpu_named
from .planner.predict import plan_setup
from .failures import Reporting
from .run_dir import ERROR_LOG, OUTPUTS, plan_run
from .run_log import find_checkpoint
from .train import TRAIN_MEMORY_ADVICE, train
from .train_config import HF_PREFIX, OFFLOAD_MODES, PRECISIONS, TrainConfig, check_run



class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, no usage block: the message says what was wrong and how to fix it."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="train the built-in Llama or a Hugging Face model on a text corpus",
                       description="Train the built-in Llama (or a Hugging Face model, --model hf:DIR) on the built-in "
                                   "corpus (or --data FILE): all local GPUs, or 2 gloo worker processes on a CPU-only "
                                   "machine. Works under torchrun too. The workers are laid out as --dp-replicate x "
                                   "data-parallel shards x --cp x --tp (fsdp8.parallelize). SIGINT or SIGTERM stops "
                                   "after the current step with the outputs written (and a checkpoint with "
                                   "--save-every); a second one stops once a checkpoint being written is complete, "
                                   "a third at once.",
                       argument_default=argparse.SUPPRESS)  # only the flags given: a resume fills in the rest

    def flag(name: str, help: str, **kwargs) -> None:
        default = getattr(d, name[2:].replace("-", "_"))
        p.add_argument(name, help=f"{help} (default: {default})", **kwargs)

    def switch(name: str, help: str) -> None:
        # --no-NAME too: a resumed run remembers the switch, and this turns it off.
        p.add_argument(name, action=argparse.BooleanOptionalAction, help=f"{help} (default: off)")

    flag("--steps", "optimizer steps of the run", type=int)
    flag("--preset", "size of the built-in Llama", choices=sorted(PRESETS))
    p.add_argument("--model", metavar="hf:DIR",
                   help="train a Hugging Face causal LM instead of the built-in Llama: DIR is a local model directory "
                        "with a config.json, its weights if it has *.safetensors files (else a fresh init) and its "
                        "tokenizer for the data if it has one (else bytes). A preset name is the same as --preset "
                        "(default: the built-in Llama of --preset)")
    p.add_argument("--data", metavar="FILE",
                   help="a text file to train on (the last 5%% for validation), read as bytes or with --model's "
                        "tokenizer (default: the corpus shipped in the package)")
    flag("--strategy", "what is sharded: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2), "
                       "optim_grads_params (ZeRO-3)", choices=STRATEGY_NAMES)
    flag("--precision", "compute dtype; auto = bf16 on GPUs, fp32 on CPUs; fp8-* = bf16 with FP8 GEMMs and "
                        "8-bit weight all-gathers in the blocks (main weights stay fp32)", choices=PRECISIONS)
    p.add_argument("--nproc", type=int, help="worker processes (default: all GPUs, or 2 on CPU; under torchrun, "
                                             "torchrun's)")
    flag("--tp", "tensor-parallel degree: each layer split over N neighbouring ranks, which share a batch", type=int)
    flag("--dp-replicate", "HSDP: R replicas of the model, each sharded over nproc / (R x cp x tp) "
                           "data-parallel ranks", type=int)
    flag("--outer-strategy", "HSDP: what is sharded across the replicas: no_shard (gradients all-reduced), optim "
                             "(main weights and optimizer state too)", choices=("no_shard", "optim"))
    flag("--cp", "context-parallel degree: each sequence cut over N ranks, which share a batch (--seq-len a "
                 "multiple of 2 x N)", type=int)
    switch("--sequence-parallel", "with --tp: norms and residuals on sequence shards (--seq-len a multiple of tp)")
    switch("--loss-parallel", "with --tp: keep the logits vocabulary-sharded through the loss")
    flag("--ac", "activation checkpointing of each block: none, selective (op-level policy; not with --cp) or "
                 "full (recompute the block)", choices=AC_MODES)
    switch("--compile", "torch.compile each block")
    flag("--offload", "optim: main weights, gradients and optimizer state in host memory, the optimizer step on "
                      "the CPU", choices=OFFLOAD_MODES)
    flag("--out", "directory for metrics.jsonl, loss.png, summary.json and checkpoints/")
    flag("--batch-size", "sequences per data-parallel rank per step: the ranks of one tp x cp group share "
                         "theirs, so a step trains on batch-size x nproc / (tp x cp) sequences", type=int)
    flag("--seq-len", "tokens per sequence, at most the model's positions (presets: "
                      + ", ".join(f"{name}: {c.max_seq_len}" for name, c in PRESETS.items()) + ")", type=int)
    flag("--micro-batches", "gradient-accumulation micro-batches per step (they split --batch-size)", type=int)
    flag("--lr", "peak learning rate: linear warm-up, then cosine decay to a tenth over the run", type=float)
    flag("--seed", "seed of the initial weights and of the batches", type=int)
    flag("--log-every", "steps per metrics record and progress update", type=int)
    flag("--eval-every", "steps between validation losses", type=int)
    flag("--save-every", "checkpoint every N steps, and when stopped by a signal, under OUT/checkpoints "
                         "(0: never)", type=int)
    flag("--keep-last", "checkpoints of this run to keep", type=int)
    p.add_argument("--resume", nargs="?", const=None, metavar="DIR",
                   help="continue a run from its latest checkpoint; DIR is a run directory, its checkpoints/ "
                        "folder or one checkpoint (default: --out). Settings not given again, --steps and "
                        "--save-every included, and the LR schedule come from the checkpoint; the outputs go "
                        "to the run's directory unless --out is given, and cover the whole run")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that holds an earlier run, deleting its "
                        f"{', '.join(OUTPUTS)} first (default: refuse to start there)")
    flag("--stop-at", "stop after this step with a checkpoint, as if interrupted (0: run to --steps)", type=int)
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background thread (default: training waits for each)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the metrics (loss, val loss, lr, grad norm, tokens/s, memory) as TensorBoard "
                        "event files into DIR, covering the whole run as metrics.jsonl does (events an earlier "
                        "run left there are hidden); needs pip install tensorboard (default: none)")


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model as safetensors (a transformers model where it is "
                                      "one)",
                       description="Check an fsdp8 (or any DCP) checkpoint as --resume does, read it in this one "
                                   "process and write its model weights, in full, to OUT/model.safetensors. The "
                                   "built-in Llama is written as a transformers LlamaForCausalLM (its tensor names "
                                   "and a config.json); a run of --model hf:DIR gets DIR's config.json and tokenizer "
                                   "beside the weights; other models keep the names they were saved under.")
    p.add_argument("checkpoint", help="a checkpoint, or a run directory or checkpoints/ folder: its latest one")
    p.add_argument("out", help="directory to write into (new or empty)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast floating weights (default: as saved, fp32 main weights)")
    p.add_argument("--overwrite", action="store_true",
                   help="export into a directory that holds files, replacing those an export writes "
                        "(model.safetensors, config.json, tokenizer files) (default: refuse)")


def _model_flags(p, default_model: Optional[str], what: str) -> None:
    """The model, as fsdp8 plan and bench take it: a preset, hf:DIR, or sizes (which also resize either)."""
    p.add_argument("--model", default=default_model,
                   help=f"a built-in preset ({', '.join(PRESETS)}), or hf:DIR (a Hugging Face model directory{what}); "
                        "the size flags below resize it, or describe a model alone (default: %(default)s)")
    for name, meaning in (("layers", "decoder layers"), ("hidden", "hidden size"), ("ffn", "feed-forward width"),
                          ("heads", "attention heads"), ("kv-heads", "key/value heads"), ("vocab", "vocabulary size")):
        fallback = "--heads without --model" if name == "kv-heads" else "the model's"
        p.add_argument(f"--{name}", type=int, help=f"{meaning} (default: {fallback})")
    p.add_argument("--tied", action="store_true", default=None,
                   help="tie the embedding and the head (default: as the model)")


def _layout_flags(p) -> None:
    """The parallel layout and the precision, shared by fsdp8 plan and bench."""
    p.add_argument("--strategy", default="optim_grads_params", choices=STRATEGY_NAMES,
                   help="what is sharded over data-parallel ranks (default: %(default)s)")
    p.add_argument("--outer-strategy", default="no_shard", choices=("no_shard", "optim"),
                   help="HSDP: what is sharded across replicas (default: %(default)s)")
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (default: %(default)s)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: %(default)s)")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism with tp (default: off)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="keep the logits vocabulary-sharded over tp (default: off, they are gathered)")
    p.add_argument("--fp8", default="none", choices=("none", "current", "delayed", "block", "mxfp8"),
                   help="FP8 recipe of the layers' linears (default: %(default)s)")
    p.add_argument("--ac", default="none", choices=AC_MODES, help="activation checkpointing (default: %(default)s)")
    p.add_argument("--offload", default="none", choices=("none", "optim"),
                   help="optim: main weights, gradients and optimizer state in host memory (default: %(default)s)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: plan 2048, bench 128)")
    p.add_argument("--micro-batch", type=int, help="sequences per data-parallel rank per micro-batch (default: plan 1, "
                                                   "bench 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory, communication and speed on a cluster",
                       description="Predict memory per rank (persistent memory exactly as memory_report() counts it), "
                                   "communication per step and step time of training a Llama-family model on a cluster, "
                                   "or with --search rank every configuration that fits. docs/PLANNING.md has the model.")
    _model_flags(p, None, ": reads its config.json")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU of the table (default: %(default)s)")
    for name, unit in (("gpu-memory", "GiB"), ("bf16-tflops", "TFLOP/s"), ("fp8-tflops", "TFLOP/s"),
                       ("hbm-gbps", "GB/s"), ("nvlink-gbps", "GB/s each way"), ("network-gbps", "GB/s each way")):
        p.add_argument(f"--{name}", type=float, help=f"replace the GPU's figure, in {unit} (default: the table's)")
    p.add_argument("--nodes", type=int, default=1, help="machines (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per machine (default: %(default)s)")
    p.add_argument("--global-batch", type=int,
                   help="sequences per optimizer step (default: micro batch x data-parallel ranks; --search: one per GPU)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="compute dtype (default: %(default)s)")
    _layout_flags(p)
    p.add_argument("--search", action="store_true",
                   help="rank every configuration that fits (strategies, HSDP, tp, AC, micro batch, offload) instead; "
                        "with --cp N also every context-parallel degree dividing N")
    p.add_argument("--top", type=int, default=10, help="configurations --search prints (default: %(default)s)")


def _bench_parser(sub) -> None:
    d = BenchConfig()
    p = sub.add_parser("bench", help="measure a configuration here, beside the planner's prediction",
                       description="Train a configuration for a few steps on this machine (all GPUs, or 2 gloo workers "
                                   "on a CPU) and print tokens/s/GPU, MFU, peak memory and exposed communication beside "
                                   "the planner's prediction and their ratio.")
    _model_flags(p, d.model, ": needs transformers")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps before timing (default: %(default)s)")
    p.add_argument("--accumulation", type=int, default=d.accumulation,
                   help="micro-batches per optimizer step (default: %(default)s)")
    p.add_argument("--precision", default=d.precision, choices=BENCH_PRECISIONS,
                   help="compute dtype; auto = bf16 on GPUs, fp32 on CPUs (default: %(default)s)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the planner's GPU (default: the one found here)")
    p.add_argument("--nproc", type=int, help="worker processes (default: all GPUs, or 2 on CPU; under torchrun, "
                                             "torchrun's)")
    p.add_argument("--no-host-probe", dest="host_probe", action="store_false",
                   help="predict the host's cost of issuing kernels from fixed per-op costs instead of measuring this "
                        "machine's on a tiny copy of the configuration first (a few seconds)")
    _layout_flags(p)


def _fail(command: str, message: str):
    print(f"fsdp8 {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _model_settings(settings: dict) -> None:
    """``--model NAME`` of a preset is ``--preset NAME``; ``--model hf:DIR`` replaces the built-in Llama."""
    model = settings.get("model")
    if model is None or model.startswith(HF_PREFIX):
        if model is not None and "preset" in settings:
            raise ValueError(f"--preset sizes the built-in Llama, which --model {model} replaces; pass one of them")
        return
    if model not in PRESETS:
        raise ValueError(f"--model takes hf:DIR (a Hugging Face model directory) or a built-in preset "
                         f"({', '.join(PRESETS)}), got {model!r}")
    if settings.setdefault("preset", model) != model:
        raise ValueError(f"--model {model} and --preset {settings['preset']} name different presets; pass one of them")
    del settings["model"]


def _run_train(args: argparse.Namespace) -> int:
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "nproc")}
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        _model_settings(settings)
        given = set(settings)
        if "resume" in given:
            settings["resume"] = args.resume or settings.get("out", TrainConfig.out)
        plan = plan_run(TrainConfig(**settings), given, lock=rank0)
    except (ValueError, FileNotFoundError) as e:
        _fail("train", str(e))
    with plan:  # the run directory stays locked until the workers are gone
        cfg = plan.cfg
        try:
            nproc = None if under_torchrun() else resolve_nproc(getattr(args, "nproc", None))
            check_run(cfg, int(os.environ["WORLD_SIZE"]) if nproc is None else nproc)
        except (ValueError, FileNotFoundError) as e:
            _fail("train", str(e))
        if rank0:
            for note in plan.start():
                print(note, file=sys.stderr)
        reporting = Reporting("fsdp8 train", os.path.join(cfg.out, ERROR_LOG), TRAIN_MEMORY_ADVICE)
        return launch(train_worker, (cfg,), nproc=nproc, reporting=reporting)


def train_worker(cfg: TrainConfig):
    """``train`` as the command runs it on every rank. Without the library's warning about layers
    kept in high precision under FP8: it speaks of fully_shard's units= and comes from every
    rank, and the start-up line says which layers stay in bf16 instead. With tqdm's lock a
    thread lock: Inductor's compilation opens a (disabled) tqdm bar, for which tqdm makes a
    process-shared lock, a named semaphore, at the first bar. It is unregistered at interpreter
    exit, which spawned workers skip (launch.py), so the resource tracker reported it leaked
    after every --compile run. No tqdm bar is shared between processes here."""
    try:
        import tqdm
    except ImportError:  # torch then uses a stand-in that makes no lock
        pass
    else:
        tqdm.tqdm.set_lock(threading.RLock())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HighPrecisionLayerWarning)
        return train(cfg)


def _run_export(args: argparse.Namespace) -> int:
    import torch

    try:
        checkpoint = find_checkpoint(args.checkpoint)
        held = held_files(args.out)
    except (FileNotFoundError, FileExistsError) as e:
        _fail("export", str(e))
    if held and not args.overwrite:
        _fail("export", f"{args.out} already holds files ({describe_files(held)}); give an empty or new directory, or "
                        "--overwrite to replace the files an export writes there (model.safetensors, config.json, "
                        "tokenizer files)")
    problems = verify(checkpoint)
    if not problems:
        try:
            export(checkpoint, args.out, getattr(torch, args.dtype) if args.dtype else None, overwrite=args.overwrite)
        except DamagedCheckpointError as e:  # found reading it: an item that fails its checksum, say
            problems = [str(e)]
        except (CheckpointError, OSError, ValueError) as e:
            _fail("export", str(e))
    if problems:
        _fail("export", f"checkpoint {checkpoint} cannot be exported: {'; '.join(problems)}"
                        f"{_intact_older(checkpoint, args.out)}")
    written = [name for name in EXPORT_FILES if os.path.isfile(os.path.join(args.out, name))]
    what = ("a transformers model" if "config.json" in written
            else "tensors under the names they were saved with (no config.json: not a model transformers knows)")
    print(f"wrote {', '.join(written)} to {args.out} from {checkpoint}: {what}", file=sys.stderr)
    return 0


def _intact_older(damaged: str, out: str) -> str:
    """What to export instead of a damaged checkpoint: the newest older one beside it that reads
    back whole (every item against its checksum)."""
    damaged = os.path.normpath(damaged)
    beside = complete_checkpoints(os.path.dirname(damaged) or ".")
    where = [os.path.abspath(p) for p in beside]
    older = beside[:where.index(os.path.abspath(damaged))] if os.path.abspath(damaged) in where else []
    for candidate in reversed(older):
        if not verify(candidate, data=True):
            return f"; the older checkpoint {candidate} is intact: fsdp8 export {candidate} {out}"
    return "; no older checkpoint beside it is intact" if older else ""


def _sizes(args: argparse.Namespace) -> dict:
    return {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "heads": args.heads,
            "kv_heads": args.kv_heads, "vocab": args.vocab, "tied": args.tied}


def _given(value, default):
    return default if value is None else value


def _none(value: str) -> Optional[str]:
    return None if value == "none" else value


def _run_plan(args: argparse.Namespace) -> int:
    try:
        gpu = gpu_named(args.gpu, memory_gib=args.gpu_memory, bf16_tflops=args.bf16_tflops, fp8_tflops=args.fp8_tflops,
                        hbm_gbps=args.hbm_gbps, nvlink_gbps=args.nvlink_gbps, network_gbps=args.network_gbps)
        common = dict(gpu=gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node, seq_len=_given(args.seq_len, 2048),
                      global_batch=args.global_batch, precision=args.precision, fp8=_none(args.fp8), **_sizes(args))
        if args.search:
            # --cp N: weigh every context-parallel degree that divides N (default 1: none).
            cps = tuple(d for d in range(1, args.cp + 1) if args.cp % d == 0) or (args.cp,)  # (cp,): its error
            found = search(args.model, top=args.top, loss_parallel=args.loss_parallel, cps=cps, **common)
        else:
            result = plan(args.model, micro_batch=_given(args.micro_batch, 1), strategy=args.strategy,
                          outer_strategy=args.outer_strategy, dp_replicate=args.dp_replicate, cp=args.cp, tp=args.tp,
                          sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel,
                          activation_checkpointing=args.ac,
                          offload=_none(args.offload), **common)
    except (ValueError, FileNotFoundError) as e:
        _fail("plan", str(e))
    if args.search:
        print(json.dumps([dict(c.plan.to_dict(), rank=i + 1) for i, c in enumerate(found)], indent=2) if args.json
              else _search_table(found))
        return 0
    if args.json:
        print(json.dumps(dict(result.to_dict(), fixes=[] if result.memory.fits else fixes(result)), indent=2))
        return 0
    print(result)
    if not result.memory.fits:
        found = fixes(plan_setup(result.spec, result.setup))
        print("would fit with: " + "; ".join(found) if found else
              "no change of one or two settings makes it fit: try fsdp8 plan --search, or more --nodes")
    return 0


def _search_table(found) -> str:
    first = found[0].plan
    lines = [f"fsdp8 plan --search: {first.spec.describe()}",
             f"  on {first.setup.cluster.describe()} = {first.setup.cluster.world} GPUs, seq {first.setup.seq_len}, "
             f"global batch {first.setup.global_batch}; the {len(found)} fastest distinct configurations that fit",
             f"{'#':>3} {'tokens/s/GPU':>12} {'MFU':>6} {'GiB':>6}  {'R x S x cp x tp':<16}{'strategy':<19}{'outer':<9}"
             f"{'AC':<10}{'offload':<8}{'SP':<4}{'micro x acc':>11}"]
    for i, c in enumerate(found, 1):
        mesh = f"{c.dp_replicate}x{c.dp_shard}x{c.cp}x{c.tp}"
        lines.append(f"{i:>3} {c.tokens_per_s_per_gpu:>12,.0f} {c.plan.mfu:>6.1%} {c.plan.memory.total / 2**30:>6.1f}  "
                     f"{mesh:<16}{c.strategy:<19}{c.outer_strategy:<9}{c.activation_checkpointing:<10}"
                     f"{c.offload or 'none':<8}{'yes' if c.sequence_parallel else 'no':<4}"
                     f"{f'{c.micro_batch} x {c.accumulation}':>11}")
    return "\n".join(lines)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed ``fsdp8 bench`` flags."""
    return BenchConfig(model=args.model, sizes={k: v for k, v in _sizes(args).items() if v is not None},
                       seq_len=_given(args.seq_len, BenchConfig.seq_len),
                       micro_batch=_given(args.micro_batch, BenchConfig.micro_batch),
                       accumulation=args.accumulation, steps=args.steps, warmup=args.warmup, strategy=args.strategy,
                       outer_strategy=args.outer_strategy, dp_replicate=args.dp_replicate, cp=args.cp,
                       tp=args.tp, sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel,
                       precision=args.precision, fp8=_none(args.fp8),
                       activation_checkpointing=args.ac, offload=_none(args.offload), gpu=args.gpu, json=args.json,
                       host_probe=args.host_probe)


def _run_bench(args: argparse.Namespace) -> int:
    cfg = bench_config(args)
    try:
        nproc = None if under_torchrun() else resolve_nproc(args.nproc)
        cfg.check(int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        _fail("bench", str(e))
    return launch(bench, (cfg,), nproc=nproc, reporting=Reporting("fsdp8 bench"))


def build_parser() -> argparse.ArgumentParser:
    import torch

    parser = _Parser(prog="fsdp8", description="Sharded data-parallel training with FP8.")
    parser.add_argument("--version", action="version", version=f"fsdp8 {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _export_parser(sub)
    _plan_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    run = {"train": _run_train, "export": _run_export, "plan": _run_plan, "bench": _run_bench}[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
