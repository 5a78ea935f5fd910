"""The built-in Llama (llama.py) as a ModelAdapter: its blocks as units, the Megatron tensor-parallel
plan, context parallelism by swapping each attention's ``attend``, its sizes for the planner, its
FeedForward as a SwiGLU MLP and its MoE layers' experts."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from .adapter import CPAttention, ModelAdapter, register_adapter
from .llama import Attention, FeedForward, Llama, causal_attention
from .moe import Experts, MoE
from .spec import ModelSpec, llama_spec
from .tp_plan import ExpertParallelBlock, FamilyPlan, Plan, ReplicateParallel


class LlamaAdapter(ModelAdapter):
    """The built-in Llama. Its units are fully_shard's default (the children of ``model.layers``,
    its blocks) and nothing needs to leave a checkpointed call: the generic answers."""

    def claims(self, model: nn.Module) -> bool:
        return isinstance(model, Llama)

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> Optional[FamilyPlan]:
        return llama_plan(model.config, sequence_parallel, loss_parallel)

    def supports_context_parallel(self, model: nn.Module) -> bool:
        return True

    def context_parallel(self, model: nn.Module, attention: CPAttention) -> nn.Module:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if any(layer.attend is not causal_attention for layer in layers):
            raise ValueError("the model's attention is already replaced (context_parallel applied twice?); "
                             "apply it once")
        for layer in layers:
            layer.attend = attention
        model.register_forward_pre_hook(_pre_forward(attention, model.config.max_seq_len), prepend=True,
                                        with_kwargs=True)
        return model

    def planner_spec(self, model: nn.Module) -> ModelSpec:
        return llama_spec(model.config, "model")

    def swiglu_names(self, module: nn.Module) -> Optional[Tuple[str, str, str]]:
        # The exact class: a subclass may compute something else with the same children.
        return ("w1", "w3", "w2") if type(module) is FeedForward else None

    def load_balancing_modules(self, model: nn.Module) -> List[nn.Module]:
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        if not layers:
            raise ValueError("load_balancing='global' applies to a mixture-of-experts model's router loss, and this "
                             "built-in Llama is dense (num_experts=0); leave load_balancing='local'")
        return layers

    def experts(self, model: nn.Module) -> Dict[str, nn.Module]:
        return {name: m for name, m in model.named_modules() if isinstance(m, Experts)}


def _pre_forward(attention: CPAttention, max_seq_len: int):
    """Check this rank's part of the sequences and give Llama.forward their global positions."""

    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("tokens")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            return None  # Llama.forward itself names the bad input
        local = tokens.shape[1]
        attention.check_local_length(local)
        if local * attention.cp > max_seq_len:
            raise ValueError(
                f"this rank's {local} tokens per sequence are part of sequences of {local * attention.cp} tokens over "
                f"cp={attention.cp}, more than max_seq_len={max_seq_len}; build the model with a larger max_seq_len"
            )
        if kwargs.get("positions") is None:
            kwargs = {**kwargs, "positions": attention.positions(local, tokens.device)}
        return args, kwargs

    return hook


def llama_plan(config, sequence_parallel: bool = False, loss_parallel: bool = False) -> FamilyPlan:
    """The built-in Llama's plan (``config``: its LlamaConfig): the Megatron layout, as
    torchtitan's parallelize_llama.

    Attention and feed-forward are column- then row-parallel (one all-reduce each); the
    embedding is vocabulary-sharded; the head is column-parallel and, with loss parallel,
    leaves its logits vocabulary-sharded (``Shard(-1)``) for ``loss_parallel()``. With
    sequence parallel the residual stream between blocks is sequence-sharded (``Shard(1)``):
    norms run on sequence shards, the input of attention and feed-forward is all-gathered
    and their output reduce-scattered instead of all-reduced. A mixture-of-experts feed-forward
    (``num_experts`` > 0) is an ``ExpertParallelBlock`` instead: its router replicated, its experts
    left to expert parallelism (``ParallelConfig(ep=N)``)."""
    seq = Shard(1) if sequence_parallel else None
    head = ColwiseParallel(
        input_layouts=seq,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    styles: Plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attn.wq": ColwiseParallel(),
        "layers.*.attn.wk": ColwiseParallel(),
        "layers.*.attn.wv": ColwiseParallel(),
        "layers.*.attn.wo": RowwiseParallel(output_layouts=seq),
        "head": head,
    }
    # Norms on the residual stream: on sequence shards, or whole and replicated.
    norm = SequenceParallel if sequence_parallel else ReplicateParallel
    styles.update({"norm": norm(), "layers.*.attn_norm": norm(), "layers.*.ffn_norm": norm()})
    if sequence_parallel:
        # attention(x, cos, sin): gather x's sequence; cos/sin are full-length tables already.
        styles["layers.*.attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None))
    if config.num_experts:
        # The residual stream between blocks is plain (local shards under sequence parallel).
        styles["layers.*.ffn"] = ExpertParallelBlock(sequence_parallel, use_local_output=True)
    else:
        styles.update({"layers.*.ffn.w1": ColwiseParallel(), "layers.*.ffn.w3": ColwiseParallel(),
                       "layers.*.ffn.w2": RowwiseParallel(output_layouts=seq)})
        if sequence_parallel:
            styles["layers.*.ffn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    heads = [("n_heads", config.n_heads, "layers.*.attn.wq"), ("n_kv_heads", config.n_kv_heads, "layers.*.attn.wk")]
    return FamilyPlan(styles, heads=heads, vocab_modules=("embed", "head"))


register_adapter(LlamaAdapter())
