"""``fsdp8 train``, the command: its flags, everything checked in the launching process before a
worker starts (flags, the run directory, the checkpoint to resume), and the launch."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import warnings

from ...config import AC_MODES, STRATEGY_NAMES
from ...fp8.convert import HighPrecisionLayerWarning
from ...models.llama import PRESETS
from ..args import OFFLOAD_MODES, TRAIN_PRECISIONS, fail
from ..failures import Reporting
from ..launch import launch, resolve_nproc, under_torchrun
from .config import HF_PREFIX, TrainConfig, check_run
from .loop import TRAIN_MEMORY_ADVICE, train
from .run_dir import ERROR_LOG, OUTPUTS, plan_run


def add_parser(sub) -> None:
    defaults = TrainConfig().settings()
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
        default = defaults[name[2:].replace("-", "_")]
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
                        "8-bit weight all-gathers in the blocks (main weights stay fp32)", choices=TRAIN_PRECISIONS)
    p.add_argument("--nproc", type=int, help="worker processes (default: all GPUs, or 2 on CPU; under torchrun, "
                                             "torchrun's)")
    flag("--tp", "tensor-parallel degree: each layer split over N neighbouring ranks, which share a batch", type=int)
    flag("--dp-replicate", "HSDP: R replicas of the model, each sharded over nproc / (R x cp x tp) "
                           "data-parallel ranks", type=int)
    flag("--outer-strategy", "HSDP: what is sharded across the replicas: no_shard (gradients all-reduced), optim "
                             "(main weights and optimizer state too)", choices=("no_shard", "optim"))
    flag("--cp", "context-parallel degree: each sequence cut over N ranks, which share a batch (--seq-len a "
                 "multiple of 2 x N)", type=int)
    flag("--ep", "expert-parallel degree of a mixture-of-experts model (--preset moe-*): its experts split over N "
                 "of the data-parallel ranks, tokens sent to them and back with all-to-all", type=int)
    switch("--fp8-dispatch", "with --ep: tokens sent to their experts' ranks as e4m3 bytes with one scale per 128 "
                              "values (about half bf16's bytes); the experts compute on them rounded to FP8")
    flag("--load-balancing", "a mixture-of-experts router's load-balancing loss: local (each rank's tokens, as "
                             "data parallelism) or global (the experts' token counts of the whole global batch)",
         choices=("local", "global"))
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


def run(args: argparse.Namespace) -> int:
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "nproc")}
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        _model_settings(settings)
        given = set(settings)
        if "resume" in given:
            settings["resume"] = args.resume or settings.get("out", TrainConfig.out)
        plan = plan_run(TrainConfig.from_settings(settings), given, lock=rank0)
    except (ValueError, FileNotFoundError) as e:
        fail("train", str(e))
    with plan:  # the run directory stays locked until the workers are gone
        cfg = plan.cfg
        try:
            nproc = None if under_torchrun() else resolve_nproc(getattr(args, "nproc", None))
            check_run(cfg, int(os.environ["WORLD_SIZE"]) if nproc is None else nproc)
        except (ValueError, FileNotFoundError) as e:
            fail("train", str(e))
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
    exit, which spawned workers skip (app/launch.py), so the resource tracker reported it leaked
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
