"""Weights into fsdp8: fill a sharded model from safetensors files (e.g. a Hugging Face
checkpoint directory), each rank reading only the rows it owns."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..engine.state_dict import StateDictError, describe_mismatch
from ..fp8.convert import Float8Conv1D
from . import safetensors
from .fused_experts import FusedExperts, find_fused, model_path


KeyMap = Union[None, Mapping[str, str], Callable[[str], str]]


@dataclass(eq=False)
class _Target:
    """A tensor load_pretrained fills, under every name the model knows it by (tied
    parameters have several)."""

    names: List[str]
    tensor: torch.Tensor
    transposed: bool = False  # a Float8Conv1D weight: stored (out, in), HF files hold (in, out)
    unit: object = None  # the ShardedUnit and ParamSlot of a sharded parameter
    slot: object = None
    file_name: Optional[str] = None
    fused: Optional[FusedExperts] = None  # experts the files store one at a time (fused_experts.py)


def load_pretrained(model: nn.Module, path: str, key_map: KeyMap = None, strict: bool = True) -> List[str]:
    """Fill ``model`` (sharded or not, e.g. just built on meta and sharded) from safetensors
    at ``path`` (a file or a directory, e.g. a Hugging Face checkpoint). A sharded model's
    ranks read only their own rows.

    Each tensor is looked up in the files under the name ``key_map`` gives (a dict
    ``{model name: file name}`` or a callable ``model name -> file name``), when it gives
    another one; else under its own name, and failing that under the names Hugging Face
    checkpoints use for it: with the model's ``base_model_prefix`` added or removed (a
    ``LlamaModel`` file into ``LlamaForCausalLM`` and back), ``embed_out`` for the head
    (GPT-NeoX), and the renames of the model class's ``_checkpoint_conversion_mapping``.
    Tied parameters load once, from any of their names. A Float8Conv1D weight (a converted
    GPT-2 projection, stored (out, in)) is read transposed from files that hold HF's (in, out)
    layout; files whose converted-Conv1D weights all have the (out, in) shape (an ``export``
    of such a model) load as they are (a model whose converted weights are all square cannot
    tell the two apart and takes HF's layout). Each rank of a sharded model reads only the
    block it keeps from the memory-mapped files: its rows, of its piece under tensor
    parallelism (a column range of the file for a dim-1 piece; rows and columns swap for a
    transposed weight); buffers and unsharded models are read whole.

    Returns the names not found with ``strict=False``. Otherwise missing names, and always
    mis-shaped ones, raise one error that lists them with the file keys nothing used."""
    files, found, hf_layout, missing = _match(model, path, key_map, strict)
    with torch.no_grad():
        for target in found:
            flip = target.transposed and hf_layout  # the file holds the transpose of the model's tensor
            if target.unit is None:
                value = _read(files, target)
                target.tensor.copy_(value.t() if flip else value)
                continue
            region = _rank_region(target)
            value = _read(files, target, region[::-1] if flip else region)
            target.unit.main_view(target.slot).copy_(value.t() if flip else value)
            target.unit.mark_stale()
    return missing


def check_pretrained(model: nn.Module, path: str, key_map: KeyMap = None, strict: bool = True) -> List[str]:
    """What ``load_pretrained`` checks before it reads a tensor (the files' headers, names and
    shapes against ``model``, e.g. one on the meta device), raising as it would: the launcher
    of ``fsdp8 train`` checks a model directory with it before any worker starts."""
    return _match(model, path, key_map, strict)[3]


def _match(model: nn.Module, path: str, key_map: KeyMap, strict: bool):
    """The files at ``path``, the targets found in them, whether converted Conv1D weights are
    stored transposed (HF's layout) and the names not found; raises for a mismatch."""
    files = safetensors.SafetensorsDir(path)
    engine = getattr(model, "_fsdp8", None)
    targets = _sharded_targets(model, engine) if engine is not None else _plain_targets(model)
    lookup = _name_lookup(model, files, key_map, targets)
    missing = []
    for target in targets:
        target.file_name = lookup(target.names)
        if target.file_name is None:
            target.fused = find_fused(target.names, files)
        if target.file_name is None and target.fused is None:
            asked = _asked(key_map, target.names[0])
            missing.append(target.names[0] if asked is None else f"{target.names[0]} (as {asked})")
    found = [t for t in targets if t.file_name is not None or t.fused is not None]
    hf_layout = all(_file_shape(files, t) == tuple(t.tensor.shape)[::-1] for t in found if t.transposed)
    mis_shaped = []
    for target in found:
        flip = target.transposed and hf_layout
        want = tuple(target.tensor.shape)[::-1] if flip else tuple(target.tensor.shape)
        if _file_shape(files, target) != want:
            note = " (a converted Conv1D, stored (out, in))" if target.transposed else ""
            mis_shaped.append(f"{target.names[0]}: file {_file_shape(files, target)} vs model {want}{note}")
    if mis_shaped or (strict and missing):
        used = {t.file_name for t in found} | {n for t in found if t.fused for part in t.fused.parts for n in part}
        unused = [n for n in files.names() if n not in used]
        message = describe_mismatch(missing, [], mis_shaped)
        if unused:
            message += f"; unused file keys ({len(unused)}): {', '.join(unused)}"
        if missing:
            message += ("; pass key_map={model name: file name} or key_map=callable(model name) -> file name "
                        "for names that differ")
        raise StateDictError(f"safetensors at {path} do not match {type(model).__name__}: {message}")
    return files, found, hf_layout, missing


def _rank_region(target: _Target) -> List[Tuple[int, int]]:
    """The block of a sharded parameter's global tensor that this rank keeps: its rows of its
    tensor-parallel piece (the whole tensor without TP), and that piece's columns."""
    start, stop = target.slot.layout.chunk_row_range(target.unit.chunk_index)
    inner = target.slot.inner
    if inner is None:
        return [(start, stop)] + [(0, n) for n in target.tensor.shape[1:]]
    (_, *piece_cols), (row0, *col0) = inner.local_region()
    return [(row0 + start, row0 + stop)] + [(o, o + n) for o, n in zip(col0, piece_cols)]


def _file_shape(files, target: _Target) -> Tuple[int, ...]:
    if target.fused is not None:
        return target.fused.shape(files)
    return tuple(files.file_of(target.file_name).shape(target.file_name))


def _read(files, target: _Target, region=None) -> torch.Tensor:
    if target.fused is not None:
        return target.fused.read(files, region)
    return files.file_of(target.file_name).read(target.file_name, region)


def _asked(key_map: KeyMap, name: str) -> Optional[str]:
    """The file name ``key_map`` gives for ``name``, if it gives another one."""
    if key_map is None:
        return None
    asked = key_map.get(name, name) if isinstance(key_map, Mapping) else key_map(name)
    return None if asked == name else asked


def _name_lookup(model: nn.Module, files, key_map: KeyMap, targets: List[_Target]):
    """names -> the file name they load from, or None (see load_pretrained)."""
    if key_map is not None and not isinstance(key_map, Mapping) and not callable(key_map):
        raise TypeError(f"key_map must be a dict {{model name: file name}} or a callable, got {type(key_map).__name__}")
    exact = {n for t in targets for n in t.names if n in files}
    hf_names = _hf_names(model)
    inferred: Dict[str, str] = {}
    for file_name in files.names():
        if file_name not in exact:
            for name in hf_names(file_name):
                inferred.setdefault(name, file_name)

    def lookup(names: List[str]) -> Optional[str]:
        asked = [a for a in (_asked(key_map, n) for n in names) if a is not None]
        if asked:
            return next((a for a in asked if a in files), None)
        return next((n for n in names if n in files), None) or next((inferred[n] for n in names if n in inferred), None)

    return lookup


def _hf_names(model: nn.Module) -> Callable[[str], List[str]]:
    """file name -> what a Hugging Face checkpoint's tensor of that name may be called in ``model``."""
    renames = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    head_name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    prefix = getattr(model, "base_model_prefix", "")
    prefix = prefix if isinstance(prefix, str) else ""
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)

    def names(file_name: str) -> List[str]:
        name = model_path(file_name)
        for pattern, replacement in renames.items():
            name, count = re.subn(pattern, replacement, name)
            if count:
                break  # the first matching rule wins, as in transformers
        if head_name is not None:
            name = re.sub(r"^embed_out\.", f"{head_name}.", name)  # GPT-NeoX checkpoints name the head embed_out
        if has_base and not name.startswith(prefix + "."):
            return [name, f"{prefix}.{name}"]  # a base model's file into a model with a head
        if prefix and not has_base and name.startswith(prefix + "."):
            return [name, name[len(prefix) + 1:]]  # a file of a model with a head into its base model
        return [name]

    return names


def _transposed_weights(model: nn.Module) -> set:
    return {id(m.weight) for m in model.modules() if isinstance(m, Float8Conv1D)}


def _plain_targets(model: nn.Module) -> List[_Target]:
    by_tensor: Dict[int, _Target] = {}
    transposed = _transposed_weights(model)
    for name, tensor in model.state_dict(keep_vars=True).items():
        target = by_tensor.get(id(tensor))
        if target is None:
            by_tensor[id(tensor)] = _Target([name], tensor, transposed=id(tensor) in transposed)
        else:
            target.names.append(name)
    return list(by_tensor.values())


def _sharded_targets(model: nn.Module, engine) -> List[_Target]:
    """Every distinct parameter of a sharded model (loaded into its main rows) and its
    persistent buffers."""
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    targets = []
    for unit in engine.all_units:
        for slot in unit.slots:
            names = [slot.fqn] + [f"{module_names[id(m)]}.{a}".lstrip(".") for m, a in slot.aliases]
            transposed = any(isinstance(m, Float8Conv1D) and a == "weight" for m, a in slot.aliases)
            targets.append(_Target(list(dict.fromkeys(names)), slot.main, transposed, unit, slot))
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent:  # non-persistent buffers (e.g. rotary tables) are not weights
            targets.append(_Target([name], buf))
    return targets
