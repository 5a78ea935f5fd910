"""What the subcommands of the ``fsdp8`` command share: a parser whose errors are one line, the
model and layout flags of ``fsdp8 plan`` and ``fsdp8 bench``, the ParallelConfig that the layout
flags of all three commands make (checked, in the flags' words), and how a command fails."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Mapping, Optional

from ..config import AC_MODES, BF16_MIXED, STRATEGY_NAMES, LayoutError, ParallelConfig, Precision
from ..fp8.recipes import RECIPES, recipe_from_name
from ..models.llama import PRESETS

PRECISIONS = ("auto", "fp32", "bf16")  # auto: resolve_precision's choice (bf16 on GPUs, fp32 on CPUs)
TRAIN_PRECISIONS = PRECISIONS + tuple(RECIPES)  # fsdp8 train's --precision fp8-NAME: bf16 with FP8 layers
OFFLOAD_MODES = ("none", "optim")
_PRECISION = {"auto": None, "fp32": Precision(), "bf16": BF16_MIXED}


class Parser(argparse.ArgumentParser):
    """The ``fsdp8`` command's parser (its subcommands' too): errors are one line."""

    def error(self, message: str):
        """One line, no usage block: the message says what was wrong and how to fix it."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(command: str, message: str):
    """End ``fsdp8 command`` with ``message`` in one line, as a bad flag does (exit status 2)."""
    print(f"fsdp8 {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def model_flags(p, default_model: Optional[str], what: str) -> None:
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


def layout_flags(p) -> None:
    """The parallel layout and the precision, shared by fsdp8 plan and bench."""
    p.add_argument("--strategy", default="optim_grads_params", choices=STRATEGY_NAMES,
                   help="what is sharded over data-parallel ranks (default: %(default)s)")
    p.add_argument("--outer-strategy", default="no_shard", choices=("no_shard", "optim"),
                   help="HSDP: what is sharded across replicas (default: %(default)s)")
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (default: %(default)s)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: %(default)s)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree of a mixture-of-experts model: its experts split over N of the "
                        "dp_shard ranks, tokens sent to them with all-to-all (default: %(default)s)")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism with tp (default: off)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="keep the logits vocabulary-sharded over tp (default: off, they are gathered)")
    p.add_argument("--fp8", default="none", choices=("none", "current", "delayed", "block", "mxfp8"),
                   help="FP8 recipe of the layers' linears (default: %(default)s)")
    p.add_argument("--ac", default="none", choices=AC_MODES, help="activation checkpointing (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer, as ParallelConfig(compile=True) (default: off, eager)")
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="with --ep: tokens sent to their experts' ranks as FP8 bytes with 1x128 scales (default: off)")
    p.add_argument("--offload", default="none", choices=OFFLOAD_MODES,
                   help="optim: main weights, gradients and optimizer state in host memory (default: %(default)s)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: plan 2048, bench 128)")
    p.add_argument("--micro-batch", type=int, help="sequences per data-parallel rank per micro-batch (default: plan 1, "
                                                   "bench 2)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def sizes(args: argparse.Namespace) -> dict:
    return {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "heads": args.heads,
            "kv_heads": args.kv_heads, "vocab": args.vocab, "tied": args.tied}


def given(value, default):
    return default if value is None else value


def none(value: str) -> Optional[str]:
    return None if value == "none" else value


def flags_of(parallel: ParallelConfig) -> dict:
    """The layout flags, by argparse name, that make ``parallel`` as fsdp8 train spells them
    (``--precision fp8-NAME``): what parallel_from_flags takes back."""
    p = parallel
    precision = f"fp8-{p.fp8.name}" if p.fp8 is not None else "auto" if p.precision is None else p.precision.label
    return {"strategy": p.strategy.label, "precision": precision, "tp": p.tp, "ep": p.ep, "dp_replicate": p.dp_replicate,
            "outer_strategy": p.outer_strategy.label, "cp": p.cp, "sequence_parallel": p.sequence_parallel,
            "loss_parallel": p.loss_parallel, "ac": p.activation_checkpointing, "compile": p.compile,
            "offload": p.offload or "none", "load_balancing": p.load_balancing, "fp8_dispatch": p.fp8_dispatch}


# Every layout flag (fsdp8 plan and bench name the FP8 recipe with --fp8) and its default.
LAYOUT_DEFAULTS = dict(flags_of(ParallelConfig()), fp8="none")


def parallel_from_flags(flags: Mapping[str, Any]) -> ParallelConfig:
    """The ParallelConfig of the layout flags among ``flags`` (parsed flags or saved settings, by
    argparse name; the others are not read, a missing one takes its default), checked once, by
    ParallelConfig, with what it refuses said in terms of the flags. ``--precision auto`` leaves
    the choice to ``resolve_precision`` where the model runs; FP8 layers compute in bf16."""
    f = dict(LAYOUT_DEFAULTS, **{name: value for name, value in flags.items() if name in LAYOUT_DEFAULTS})
    for name in ("tp", "ep", "dp_replicate", "cp"):
        if f[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {f[name]}")
    precision, fp8 = f["precision"], f["fp8"]
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(TRAIN_PRECISIONS)}, got {precision!r}")
    if precision in RECIPES:
        fp8_flag, fp8 = f"--precision {precision}", precision[len("fp8-"):]
    else:
        fp8_flag = f"--fp8 {fp8}" if fp8 != "none" else None
    if fp8_flag and precision == "fp32":
        raise ValueError(f"{fp8_flag} computes in bf16 (FP8 layers take bf16 inputs), which --precision fp32 "
                         "contradicts; pass --precision bf16, or drop --fp8")
    if fp8_flag:  # what "auto" would leave to the device, FP8 layers fix: they compute in bf16
        precision = "bf16"
    if fp8_flag and f["offload"] != "none":
        fix = "use --precision bf16" if fp8_flag.startswith("--precision") else "drop --fp8"
        raise ValueError(f"--offload {f['offload']} does not work with {fp8_flag} yet (FP8 weights are quantized from "
                         f"the main weights on the device); {fix}, or no --offload")
    try:
        return ParallelConfig(dp_replicate=f["dp_replicate"], cp=f["cp"], tp=f["tp"], ep=f["ep"],
                              sequence_parallel=f["sequence_parallel"], loss_parallel=f["loss_parallel"],
                              activation_checkpointing=f["ac"], compile=f["compile"],
                              fp8=recipe_from_name(f"fp8-{fp8}") if fp8 != "none" else None,
                              precision=_PRECISION[precision], strategy=f["strategy"],
                              outer_strategy=f["outer_strategy"], offload=none(f["offload"]),
                              load_balancing=f["load_balancing"], fp8_dispatch=f["fp8_dispatch"])
    except LayoutError as e:
        raise ValueError(_in_flags(e.rule, f) or str(e)) from None
    except TypeError as e:  # a saved setting of the wrong type
        raise ValueError(str(e)) from None


def _in_flags(rule: str, f: dict) -> Optional[str]:
    """What ParallelConfig refused (``LayoutError.rule``), in terms of the flags ``f``."""
    if rule == "needs_tensor_parallel":
        wanting = [f"--{name.replace('_', '-')}" for name in ("sequence_parallel", "loss_parallel") if f[name]]
        flags = " and ".join(wanting)
        return (f"{flags} need{'s' if len(wanting) == 1 else ''} tensor parallelism: pass --tp N (N > 1) too, or "
                f"drop {flags}")
    if rule == "outer_without_replicas":
        return (f"--outer-strategy {f['outer_strategy']} shards across HSDP replicas, but there are none; pass "
                "--dp-replicate R (R > 1) too, or drop --outer-strategy")
    if rule == "activation_checkpointing":
        return f"--ac must be one of {', '.join(AC_MODES)}, got {f['ac']!r}"
    if rule == "selective_with_cp":
        return (f"--ac selective does not work with --cp {f['cp']} yet (the selective policy cannot create the "
                "context-parallel attention's causal mask); use --ac full")
    if rule == "offload":
        return f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {f['offload']!r}"
    if rule == "fp8_dispatch_without_ep":
        return ("--fp8-dispatch sends tokens to their experts' ranks in FP8, but without --ep N (N > 1) none are "
                "sent; pass --ep too, or drop --fp8-dispatch")
    if rule == "offload_without_sharding":
        return ("--offload optim moves the sharded main weights and optimizer state to the host, but --strategy "
                "no_shard shards nothing; use --strategy optim or higher")
    return None
