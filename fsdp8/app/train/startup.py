"""What ``fsdp8 train`` says as it starts, in its own terms: the model and its layout, where the
weights come from, which layers run in FP8, and the data with its size in tokens."""

from __future__ import annotations

import re
from typing import List, Optional

import torch.nn as nn

from ...fp8.convert import is_fp8_experts, projection_layers
from .config import TrainConfig, weight_files

_NAMES_SHOWN = 4


def startup_lines(cfg: TrainConfig, model: nn.Module, *, params: int, world: int, device: str, layout: str,
                  compute: str, tokens_per_step: int, tokenized: bool, train_tokens: int, val_tokens: int,
                  resumed_from: Optional[str], first_step: int) -> str:
    """The first line of a run, then one line each for the weights, the FP8 layers (with an
    fp8 precision) and the data. ``model`` is the parallelized model; ``tokenized`` whether the
    data was read with the model's tokenizer (else as bytes)."""
    lines = [f"fsdp8 train: {cfg.model_name} ({params / 1e6:.2f}M params), {world} x {device} as {layout}, "
             f"strategy {cfg.parallel.strategy.label}, {compute} compute, {tokens_per_step} tokens/step",
             f"  weights: {_weights(cfg, resumed_from, first_step)}"]
    if cfg.parallel.fp8 is not None:
        lines.append(f"  fp8: {_fp8_layers(model)}")
    data = f"--data {cfg.data}" if cfg.data else "the packaged corpus"
    reader = f"tokenized with the tokenizer of {cfg.model}" if tokenized else "read as bytes"
    lines.append(f"  data: {data}, {reader}: {train_tokens + val_tokens:,} tokens ({train_tokens:,} train, "
                 f"{val_tokens:,} validation)")
    return "\n".join(lines)


def _weights(cfg: TrainConfig, resumed_from: Optional[str], first_step: int) -> str:
    if resumed_from:
        return f"resumed at step {first_step} from {resumed_from}"
    if not cfg.model:
        return f"freshly initialised (seed {cfg.seed})"
    files = weight_files(cfg.hf_dir)
    if not files:
        return f"freshly initialised (seed {cfg.seed}): {cfg.hf_dir} has no *.safetensors files"
    return f"loaded from {cfg.hf_dir}: {_listed(files)}"


def _fp8_layers(model: nn.Module) -> str:
    """Which layers run FP8 GEMMs and which stay in bf16 (fp8-* computes in bf16 outside them)."""
    fp8, high = projection_layers(model)
    if not fp8:
        return f"no layer runs in FP8: every GEMM stays in bf16 ({_listed(_by_block(high))})"
    kept = f"; in bf16: {_listed(_by_block(high))}" if high else ""
    experts = sum(is_fp8_experts(m) for m in model.modules())
    what = f"{len(fp8) - experts} linear layers" + (f" and {experts} experts modules" if experts else "")
    return f"{what} run FP8 GEMMs{kept}"


def _by_block(names: List[str]) -> List[str]:
    """One entry for a layer that every block has: ``layers.*.mlp.w1 (..)`` for ``layers.0.mlp.w1 (..)``, ..."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))


def _listed(names: List[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown if len(names) <= _NAMES_SHOWN else f"{shown} and {len(names) - _NAMES_SHOWN} more"
