"""What the subcommands of the ``fsdp8`` command share: a parser whose errors are one line, the
model and layout flags of ``fsdp8 plan`` and ``fsdp8 bench``, and how a command fails."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..config import AC_MODES, STRATEGY_NAMES
from ..models.llama import PRESETS


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


def sizes(args: argparse.Namespace) -> dict:
    return {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "heads": args.heads,
            "kv_heads": args.kv_heads, "vocab": args.vocab, "tied": args.tied}


def given(value, default):
    return default if value is None else value


def none(value: str) -> Optional[str]:
    return None if value == "none" else value
