"""``fsdp8 export``, the command: a checkpoint (or a run's latest) checked and written as a Hugging
Face model directory; a damaged one is refused, naming an intact older one to export instead."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..checkpoint import export, verify
from ..checkpoint.exporter import EXPORT_FILES, describe_files, held_files
from ..checkpoint.store import CheckpointError, DamagedCheckpointError, complete_checkpoints
from .args import fail
from .train.run_log import find_checkpoint


def add_parser(sub) -> None:
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


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = find_checkpoint(args.checkpoint)
        held = held_files(args.out)
    except (FileNotFoundError, FileExistsError) as e:
        fail("export", str(e))
    if held and not args.overwrite:
        fail("export", f"{args.out} already holds files ({describe_files(held)}); give an empty or new directory, or "
                        "--overwrite to replace the files an export writes there (model.safetensors, config.json, "
                        "tokenizer files)")
    problems = verify(checkpoint)
    if not problems:
        try:
            export(checkpoint, args.out, getattr(torch, args.dtype) if args.dtype else None, overwrite=args.overwrite)
        except DamagedCheckpointError as e:  # found reading it: an item that fails its checksum, say
            problems = [str(e)]
        except (CheckpointError, OSError, ValueError) as e:
            fail("export", str(e))
    if problems:
        fail("export", f"checkpoint {checkpoint} cannot be exported: {'; '.join(problems)}"
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
