"""Hugging Face tensor-parallel plans: a model's ``config.base_model_tp_plan`` strings as torch ParallelStyles.

transformers names its styles with strings (``"colwise"``, ``"rowwise"``, ...) keyed by
module patterns relative to the base model (``"layers.*.self_attn.q_proj"``); their
meaning here is the one transformers gives them (4.5x and 5.x agree on the strings
below). Strings with no torch ParallelStyle equivalent (packed, MoE and replicated-with-
gradient-all-reduce styles) are reported unless the caller's plan covers those modules.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Dict, Mapping, Optional

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from ..fp8.tp import Float8ColwiseParallel
from .tp_plan import ExpertParallelBlock, FamilyPlan, GatherSequenceOnce, ReplicateParallel

# Projections whose output features are attention heads, and the config field counting them.
_HEAD_PROJECTIONS = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}


def _style(kind: str, sequence_parallel: bool) -> Optional[ParallelStyle]:
    # Under sequence parallel the residual stream is a sequence-sharded DTensor (HF models
    # read the sequence length and positions off the embedding output, so it must keep its
    # global shape): column-parallel projections gather it, row-parallel ones
    # reduce-scatter back into it.
    seq = Shard(1) if sequence_parallel else None
    if kind in ("colwise", "local_colwise"):  # local_*: 4.5x's same sharding without DTensor params
        # An FP8 projection (fully_shard(fp8=...)) gathers the sequence itself, in 8 bits.
        return Float8ColwiseParallel(input_layouts=seq)
    if kind in ("rowwise", "local_rowwise"):
        return RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel)
    if kind in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if kind in ("rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=not sequence_parallel)
    if kind == "sequence_parallel":
        return SequenceParallel(use_local_output=not sequence_parallel)
    # transformers >= 5.1x names the input embedding's style too (vocabulary- or
    # feature-sharded); hf_plan places the embedding vocabulary-sharded either way.
    if kind == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=not sequence_parallel)
    if kind == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=seq or Replicate(),
                               use_local_output=not sequence_parallel)
    return None


def _module_name(model: nn.Module, target: Optional[nn.Module]) -> Optional[str]:
    if target is None:
        return None
    return next((name for name, module in model.named_modules() if module is target), None)


def hf_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool,
            experts: Optional[Mapping[str, nn.Module]] = None):
    """The FamilyPlan of a Hugging Face model whose ``config.base_model_tp_plan`` names its
    modules, else None.

    ``experts`` (name -> module, the adapter's ``experts(model)``): mixture-of-experts experts,
    which expert parallelism splits instead: the plan's entries for them (transformers'
    ``packed_colwise`` / ``moe_tp_experts``) are dropped and their block (router and experts)
    becomes an ``ExpertParallelBlock``.

    Its keys are prefixed with the base model's name; the input embedding becomes
    vocabulary-sharded and the output head column-parallel (vocabulary-sharded logits with
    loss parallel). With sequence parallel, the residual stream's norms become
    SequenceParallel and the column-parallel projections gather the sequence: eagerly each
    itself, sharing one gather per input; in compiled layers their module gathers it once
    (GatherSequenceOnce)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_input_embeddings"):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    base_plan: Dict[str, str] = dict(getattr(text, "base_model_tp_plan", None) or {})
    if not base_plan:
        return None
    names = [name for name, _ in model.named_modules()]
    base = _module_name(model, getattr(model, "base_model", model)) or ""
    prefix = f"{base}." if base else ""
    if not any(fnmatchcase(name, prefix + key) for key in base_plan for name in names):
        return None  # keys relative to another module (e.g. a multimodal model's language model)
    styles, unsupported, heads = {}, {}, []
    for key, kind in base_plan.items():
        pattern = prefix + key
        style = _style(kind, sequence_parallel)
        if style is None:
            unsupported[pattern] = kind
            continue
        styles[pattern] = style
        field = _HEAD_PROJECTIONS.get(key.rsplit(".", 1)[-1])
        count = getattr(text, field, None) if field else None
        if count is None and field == "num_key_value_heads":
            count = text.num_attention_heads
        if count is not None and isinstance(style, ColwiseParallel):
            heads.append((field, count, pattern))
    per_head = per_head_norm_plan(model, styles)
    styles.update(per_head)
    # transformers' "replicated_with_grad_allreduce" on q/k norms is what the per-head styles do.
    unsupported = {pattern: kind for pattern, kind in unsupported.items()
                   if not any(fnmatchcase(name, pattern) for name in per_head)}
    styles.update(_residual_norms(model, names, styles, sequence_parallel))
    if sequence_parallel:  # after the norms: an owner's pattern would hide the norms beside it
        styles.update(_gather_once_owners(styles))
    if experts:  # after the norms: a block is no owner of sharded projections; its style (named per
        # block) comes later than the owners' patterns, so a dense layer's MLP keeps its gather
        styles, unsupported = _experts_left_to_ep(experts, styles, unsupported, sequence_parallel)
    seq = Shard(1) if sequence_parallel else None
    embed = _module_name(model, model.get_input_embeddings())
    head = _module_name(model, model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None)
    vocab = []
    if embed is not None:
        styles[embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                        use_local_output=not sequence_parallel)
        vocab.append(embed)
    if head is not None:
        styles[head] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel)
        vocab.append(head)
    return FamilyPlan(styles, heads=heads, vocab_modules=tuple(vocab), unsupported=unsupported)


def _gather_once_owners(styles: Dict[str, ParallelStyle]) -> Dict[str, ParallelStyle]:
    """GatherSequenceOnce for each module whose column-parallel projections all take the
    sequence-sharded residual stream through Float8ColwiseParallel (which passes a gathered
    input on as it is; torch's ColwiseParallel would redistribute it again)."""
    owners: Dict[str, bool] = {}
    for pattern, style in styles.items():
        if "." not in pattern or not isinstance(style, ColwiseParallel):
            continue
        owner = pattern.rsplit(".", 1)[0]
        ours = isinstance(style, Float8ColwiseParallel) and style.input_layouts[0] == Shard(1)
        owners[owner] = owners.get(owner, True) and ours
    return {owner: GatherSequenceOnce() for owner, ok in owners.items() if ok and owner not in styles}


def _experts_left_to_ep(experts: Mapping[str, nn.Module], styles: Dict[str, ParallelStyle],
                        unsupported: Dict[str, str], sequence_parallel: bool):
    """``styles`` and ``unsupported`` without the patterns that reach into an experts module,
    and an ExpertParallelBlock for each experts module's parent (the MoE block)."""
    inside = [f"{name}.{sub}" if sub else name for name, module in experts.items()
              for sub in [n for n, _ in module.named_modules()] + [n for n, _ in module.named_parameters()]]

    def kept(pattern: str) -> bool:
        return not any(fnmatchcase(name, pattern) for name in inside)

    styles = {pattern: style for pattern, style in styles.items() if kept(pattern)}
    unsupported = {pattern: kind for pattern, kind in unsupported.items() if kept(pattern)}
    # The residual stream is a sequence-sharded DTensor under sequence parallel, else plain.
    block = ExpertParallelBlock(sequence_parallel, use_local_output=not sequence_parallel)
    styles.update({name.rsplit(".", 1)[0]: block for name in experts if "." in name})
    return styles, unsupported


def _residual_norms(model: nn.Module, names, styles: Dict[str, ParallelStyle],
                    sequence_parallel: bool) -> Dict[str, ParallelStyle]:
    """The norms on the residual stream: every norm module (by class name, as HF names
    them: ``*RMSNorm``, ``*LayerNorm``) outside the modules that own a sharded projection (a
    q/k norm inside attention sees heads, not sequence shards). SequenceParallel under
    sequence parallelism, else ReplicateParallel (whole on every rank, parameters DTensors)."""
    # Owners of split projections (attention, MLP); an embedding the plan names (transformers
    # >= 5.1x's "embedding_rowwise") would make the whole base model an owner.
    modules = dict(model.named_modules())
    sharded = [name for name in names if any(fnmatchcase(name, pattern) for pattern in styles)
               and not isinstance(modules[name], nn.Embedding)]
    owners = {name.rsplit(".", 1)[0] for name in sharded if "." in name}
    norms = {}
    for name, module in model.named_modules():
        if not name or "norm" not in type(module).__name__.lower():
            continue
        if any(name == owner or name.startswith(owner + ".") for owner in owners):
            continue
        norms[name] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    return norms


def per_head_norm_plan(model: nn.Module, plan: Dict[str, ParallelStyle]) -> Dict[str, ParallelStyle]:
    """Styles for norms that see attention heads (Qwen3's and Gemma 3's ``q_norm``/``k_norm``)
    inside a module whose projections ``plan`` column-shards.

    Such a norm gets this rank's heads only, so its replicated weight's gradient is a
    partial sum over tp (transformers calls the style ``replicated_with_grad_allreduce``).
    ``SequenceParallel(sequence_dim=0)`` says just that to DTensor: the weight becomes a
    ``Replicate`` DTensor and the input a piece of a tensor whose rows (here: heads) differ
    between ranks, so the norm over the last dim stays local, the output is handed back as
    the local tensor, and the weight's gradient comes out ``Partial``, which the engine sums
    over tp. Left plain, each tp rank would update it from its own heads and the ranks'
    copies would drift apart."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    modules = dict(model.named_modules())
    owners = {name.rsplit(".", 1)[0] for name in modules
              if "." in name and any(fnmatchcase(name, p) and isinstance(s, ColwiseParallel) for p, s in plan.items())}
    styles: Dict[str, ParallelStyle] = {}
    for name, module in modules.items():
        params = list(module.parameters())
        # A head's width, not the hidden size: a norm on the residual stream is not one of these.
        per_head = params and all(p.shape[-1] == head_dim != config.hidden_size for p in params)
        if per_head and "norm" in type(module).__name__.lower() and any(name.startswith(o + ".") for o in owners):
            styles[name] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return styles
