"""The planner's model: a Llama-family decoder's sizes (models/spec.py's ModelSpec) from a preset, a Hugging
Face config.json or flags, and the parameters each unit holds on one rank (tensor-parallel pieces, FP8 or
not, experts split over ep ranks). A model instance gives its own through its adapter
(``adapter_for(model).planner_spec(model)``)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import List, Optional, Tuple

from ..config import ParallelConfig
from ..models.hf_dir import config_file, read_config
from ..models.llama import PRESETS
from ..models.spec import ModelSpec, Param, hf_spec_of, llama_spec

# Scaling-block width along a split dimension, per FP8 recipe (fp8/tp_forward.py tp_fp8_ok).
_BLOCK = {"current": 1, "delayed": 1, "block": 128, "mxfp8": 32}
FP8_RECIPES = tuple(_BLOCK)


def tp_piece(size: int, tp: int, rank: int) -> int:
    """Rows (or columns) of a dimension of ``size`` that tensor-parallel rank ``rank`` holds
    (the torch.chunk rule of DTensor Shard: the last ranks may hold fewer)."""
    chunk = -(-size // tp)
    return max(0, min(chunk, size - rank * chunk))


def local_shape(param: Param, tp: int, rank: int) -> Tuple[int, ...]:
    dim = {"col": 0, "row": 1}.get(param.tp)
    if dim is None or tp == 1:
        return param.shape
    shape = list(param.shape)
    shape[dim] = tp_piece(shape[dim], tp, rank)
    return tuple(shape)


def ep_shape(param: Param, shape: Tuple[int, ...], ep: int) -> Tuple[int, ...]:
    """``shape`` of an expert parameter on one ep rank: its experts split evenly (ep divides them)."""
    return (shape[0] // ep,) + tuple(shape[1:]) if param.expert else shape


def converts_to_fp8(param: Param, recipe: Optional[str], tp: int, rank: int) -> bool:
    """Whether fully_shard(fp8=recipe) turns this layer into a Float8Linear: dimensions that are
    multiples of 16 (fp8.convert.fp8_friendly) and, under tensor parallelism, pieces whose dims are
    multiples of 16 and whose split dimension cuts no scaling block (fp8.tp_forward.tp_fp8_ok)."""
    if recipe is None or not param.linear or any(s % 16 for s in param.shape):
        return False
    if tp == 1:
        return True
    local = local_shape(param, tp, rank)
    if any(s % 16 for s in local):
        return False
    split = local[0] if param.tp == "col" else local[1]
    return split % _BLOCK[recipe] == 0


def traces_fp8(parallel: ParallelConfig) -> bool:
    """Whether ``parallel``'s layers are compiled with their FP8 linears traced into the graph
    (fp8/linear.py), not opaque calls: every recipe under the engine (which updates delayed
    scaling's states outside the block), but under TP only what ``Recipe.traced_under_tp`` says."""
    recipe = parallel.fp8
    if recipe is None or not parallel.compiled:
        return False
    return recipe.traced_under_tp if parallel.tp > 1 else recipe.traceable


def gathers_fp8_experts(experts: List[Param], recipe: Optional[str]) -> bool:
    """Whether fully_shard(fp8=recipe) gathers a layer's ``experts`` weights as FP8 bytes: experts
    that convert (every matrix dimension a multiple of 16, fp8.convert) under a recipe whose weight
    scales are agreed before the gather or travel with the bytes (engine/fp8_experts.py: per-tensor
    current, 128x128, MX); delayed experts gather in the compute dtype and quantize themselves with
    their histories' scales (fp8/grouped_delayed.py)."""
    dims = [s for p in experts for s in p.shape[1:]]
    return bool(experts) and recipe in ("current", "block", "mxfp8") and all(s % 16 == 0 for s in dims)


def check_tp(spec: ModelSpec, tp: int) -> None:
    """The splits fsdp8.parallel.tensor_parallel refuses (whole heads per rank, the feed-forward width
    of the dense layers, if any: a mixture of experts' router and experts are not split by tp; the
    vocabulary may split unevenly), as one ValueError."""
    if tp == 1:
        return
    counts = (("heads", spec.heads), ("kv_heads", spec.kv_heads))
    if spec.moe_layers < spec.layers:  # some layer keeps the dense MLP, which tp splits
        counts += (("ffn", spec.ffn),)
    problems = [f"{what}={count}" for what, count in counts if count % tp]
    if problems:
        options = [t for t in range(1, spec.kv_heads + 1) if all(count % t == 0 for _, count in counts)]
        raise ValueError(f"tp={tp} does not divide {', '.join(problems)} of {spec.name}; use tp in {tuple(options)}")


def check_ep(spec: ModelSpec, ep: int, dp_shard: int, tp: int = 1) -> None:
    """What fsdp8.parallelize refuses of expert parallelism (parallel/manager.py, parallel/ep.py),
    as one ValueError naming ep and the fix: experts to split, ep ranks borrowed from dp_shard
    (what tp leaves of the world), whole experts per rank; and a mixture of experts beside tensor
    parallelism needs ep > 1 (tp splits attention and dense layers, the experts go to ep)."""
    options = [d for d in range(1, dp_shard + 1) if dp_shard % d == 0 and spec.experts % d == 0]
    if ep == 1:
        if tp > 1 and spec.experts:
            lower = ", so lower tp" if dp_shard == 1 else ""
            raise ValueError(f"tp={tp} with a mixture-of-experts model and ep=1: tensor parallelism splits attention "
                             f"and dense layers, and the experts go to expert parallelism; set ep to a divisor > 1 of "
                             f"dp_shard={dp_shard} (the ranks left beside tp={tp}{lower}), or use tp=1")
        return
    if not spec.experts:
        raise ValueError(f"ep={ep} splits the experts of a mixture-of-experts model, but {spec.name} is dense; use "
                         "ep=1")
    if dp_shard % ep:
        beside = f" (the ranks left beside tp={tp})" if tp > 1 else ""
        raise ValueError(f"ep={ep} must divide dp_shard={dp_shard}{beside}: expert parallelism borrows its ranks from "
                         f"the data-parallel shard dim; choose ep among {options}"
                         f"{', or lower tp' if tp > 1 else ''}")
    if spec.experts % ep:
        raise ValueError(f"ep={ep} does not divide the {spec.experts} experts of {spec.name}; choose ep among "
                         f"{options}")


def hf_spec(path: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face model directory's config.json (read here; transformers is
    not needed to plan)."""
    if not os.path.isfile(config_file(path)):
        raise FileNotFoundError(f"hf:{path}: no config.json there; give a Hugging Face model directory")
    return hf_spec_of(read_config(path), os.path.basename(os.path.normpath(path)), config_file(path))


def preset_spec(name: str) -> ModelSpec:
    """A built-in Llama preset (fsdp8.models.llama.PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: give a preset ({', '.join(PRESETS)}), hf:DIR, or the sizes "
                         "(--layers --hidden --ffn --heads --vocab)")
    return llama_spec(PRESETS[name], name)


def model_spec(model, **sizes) -> ModelSpec:
    """``model``: a ModelSpec, a preset name, ``"hf:DIR"``, or None (then ``sizes`` give every
    size); ``sizes`` (layers, hidden, ffn, heads, kv_heads, vocab, tied; None = keep) override it."""
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if isinstance(model, ModelSpec):
        base = model
    elif isinstance(model, str) and model.startswith("hf:"):
        base = hf_spec(model[3:])
    elif isinstance(model, str):
        base = preset_spec(model)
    elif model is None:
        missing = [k for k in ("layers", "hidden", "ffn", "heads", "vocab") if k not in sizes]
        if missing:
            raise ValueError(f"no model: give a preset or hf:DIR, or every size ({', '.join('--' + m for m in missing)} "
                             "missing)")
        sizes.setdefault("kv_heads", sizes["heads"])
        return ModelSpec("custom", **sizes)
    else:
        raise TypeError(f"model must be a preset name, 'hf:DIR' or a ModelSpec, got {type(model).__name__}")
    return replace(base, name=base.name + (" (resized)" if sizes else ""), **sizes)
