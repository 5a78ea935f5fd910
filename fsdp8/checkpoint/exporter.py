"""Weights out of fsdp8: a checkpoint read in full in one process (after the checks ``load``
makes), and written as safetensors, with what Hugging Face needs beside the weights."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..models.llama import PRESETS, LlamaConfig, preset
from . import extra, hf_export, safetensors, store
from .core import dcp_call
from .reader import SafeEmptyPlanner, SafeReader
from .verify import Inspection, examine

# What an export writes into its directory (--overwrite replaces exactly these).
EXPORT_FILES = ("model.safetensors", "config.json") + hf_export.TOKENIZER_FILES


def _checked(path: str) -> Inspection:
    found = examine(path)
    if found.problems:
        raise store.CheckpointError(f"cannot read checkpoint {path}: " + "; ".join(found.problems))
    return found


def _read(path: str, found: Inspection, prefix: Optional[str]) -> Dict:
    keys = [k for k in found.metadata.state_dict_metadata if prefix is None or k.startswith(prefix + ".")]
    state: Dict = {}
    dcp_call(_load_state_dict, state, storage_reader=SafeReader(path, found.metadata, found.table),
             planner=SafeEmptyPlanner(keys=set(keys)), no_dist=True)
    return state


def read_full_state(path: str, prefix: Optional[str] = None) -> Dict:
    """A checkpoint's entries (those under ``prefix``, e.g. "model"), full tensors, read in
    this process alone (no process group); nested as saved."""
    return _read(path, _checked(path), prefix)


def _model_tensors(path: str, found: Inspection) -> Dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, in full (an fsdp8 checkpoint, or a bare DCP model one)."""
    nested = any(k.startswith("model.") for k in found.metadata.state_dict_metadata)
    state = _read(path, found, "model" if nested else None)
    flat = state.get("model", state) if nested else state
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def read_full_model_state(path: str) -> Dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, in full (an fsdp8 checkpoint, or a bare DCP model one)."""
    return _model_tensors(path, _checked(path))


def export(checkpoint: str, out: str, dtype: Optional[torch.dtype] = None, *, llama: Optional[LlamaConfig] = None,
           overwrite: bool = False) -> str:
    """Write a checkpoint's model weights, in full, as ``<out>/model.safetensors``, after
    checking the checkpoint as ``load`` does; returns that file's path.

    The built-in Llama (of an ``fsdp8 train`` run, which saves its settings, or given as
    ``llama``) is written as transformers' ``LlamaForCausalLM`` (with experts,
    ``MixtralForCausalLM``): its names, and a ``config.json`` beside them. A run that trained a
    Hugging Face model (``--model hf:DIR``) gets DIR's ``config.json`` and tokenizer files beside
    the weights. Any other model's tensors keep the names they were saved under. ``dtype`` casts
    floating weights. ``out`` must be empty or new unless ``overwrite``, which replaces the files
    an export writes."""
    found = _checked(checkpoint)
    run = _run_settings(checkpoint)
    model, preset_name = run.get("model"), run.get("preset")
    if llama is None and not model and isinstance(preset_name, str) and preset_name in PRESETS:
        llama = preset(preset_name)
    hf_dir = model[len("hf:"):] if isinstance(model, str) and model.startswith("hf:") else None  # --model hf:DIR
    _prepare(out, overwrite)
    tensors = _model_tensors(checkpoint, found)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    if llama is not None:
        tensors = hf_export.llama_tensors(tensors, llama, checkpoint)
    weights_dtype = dtype or next((v.dtype for v in tensors.values() if v.is_floating_point()), torch.float32)
    hf = hf_export.hf_config(hf_dir, weights_dtype) if hf_dir is not None and llama is None else None
    target = os.path.join(out, "model.safetensors")
    safetensors.write(target, tensors, metadata={"format": "pt", "source": os.path.abspath(checkpoint)})
    if llama is not None:
        hf_export.write_json(os.path.join(out, "config.json"), hf_export.llama_config_json(llama, weights_dtype))
    elif hf is not None:
        hf_export.write_hf_files(hf_dir, out, hf)
    return target


def _run_settings(checkpoint: str) -> dict:
    """The settings ``fsdp8 train`` saved with a checkpoint (TrainConfig's fields), or {}."""
    file = store.extra_path(checkpoint, 0)
    saved = extra.read(file).get("config") if os.path.isfile(file) else None
    return saved if isinstance(saved, dict) else {}


def held_files(out: str) -> List[str]:
    """What directory ``out`` already holds (an export refuses it unless told to overwrite);
    raises FileExistsError if ``out`` is a file."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"{out} is a file; give a directory to export into")
    return sorted(os.listdir(out)) if os.path.isdir(out) else []


def describe_files(names: List[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _prepare(out: str, overwrite: bool) -> None:
    present = held_files(out)
    if present and not overwrite:
        raise FileExistsError(f"{out} already holds files ({describe_files(present)}); export into an empty or new "
                              "directory, or pass overwrite=True to replace the files an export writes there")
    for name in EXPORT_FILES:
        if name in present:
            os.remove(os.path.join(out, name))
    os.makedirs(out, exist_ok=True)
