"""The ``fsdp8`` command line: ``fsdp8 train`` (the main job), ``fsdp8 export``, ``fsdp8 plan``
(predict memory, communication and speed) and ``fsdp8 bench`` (measure beside the prediction).

Each command checks everything it can before a worker starts, in the launching process, and
reports it in one line: flags, the checkpoint to resume, the output directory.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import torch

from .. import __version__
from . import export, plan
from .args import Parser
from .bench import command as bench_command
from .train import command as train_command

COMMANDS = {"train": train_command, "export": export, "plan": plan, "bench": bench_command}


def build_parser() -> Parser:
    parser = Parser(prog="fsdp8", description="Sharded data-parallel training with FP8.")
    parser.add_argument("--version", action="version", version=f"fsdp8 {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
