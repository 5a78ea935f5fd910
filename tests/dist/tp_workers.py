"""Tensor-parallel functions run on every rank by tests/dist/test_tp.py (module-level so workers import them).

Every TP group of the world runs the same global batch (data-parallel replicas see identical
data, so no gradient reduction across them is needed) and is compared with the same model
trained in one process.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

import fsdp8
from fsdp8.parallel.mesh import make_mesh, tp_mesh
from fsdp8.parallel.tp import tensor_parallel

from . import common


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _full(a).detach().float(), _full(b).detach().float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _tp_mesh(tp: int):
    return tp_mesh(make_mesh(dp_shard=common.world() // tp, tp=tp))


def llama(vocab: int = 64, tie_embeddings: bool = False, n_heads: int = 4, n_kv_heads: int = 2, dim: int = 32,
          ffn_dim: int = 48, dtype: torch.dtype = torch.float32) -> nn.Module:
    from fsdp8.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      ffn_dim=ffn_dim, max_seq_len=16, tie_embeddings=tie_embeddings)
    return Llama(cfg).to(dtype)


def hf(family: str = "llama", vocab: int = 128, tie: bool = False, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_class(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                          tie_word_embeddings=tie, attn_implementation="sdpa")
    torch.manual_seed(0)
    return model_class(config).float()


def _llama_loss(model, x, y):
    return model(x, y)


def _hf_loss(model, x, y):
    # labels are the inputs: HF shifts them itself.
    return model(input_ids=x, labels=x).loss


def compare_training(model: nn.Module, loss_fn: Callable, tp: int, steps: int = 3, lp: bool = False,
                     lr: float = 0.5, **tp_kw) -> Dict[str, float]:
    """Worst relative error of the TP run against one process: loss and every gradient per
    step, and every weight after ``steps`` SGD steps (keys ``loss``, ``grad:<name>``,
    ``weight:<name>``; a tied parameter split in two shows as ``tied parameters split``),
    and the sequence lengths the first decoder layer's input had on this rank.

    SGD, not AdamW: Adam's update of an element whose gradient is ~0 is +-lr whatever
    its size, so fp32 rounding differences (~3e-7 relative, the floor of a reordered
    fp32 sum here) would flip such elements by a whole lr and the runs would drift."""
    reference = copy.deepcopy(model)
    tensor_parallel(model, _tp_mesh(tp), loss_parallel=lp, **tp_kw)
    layers = model.model.layers if hasattr(model, "model") else model.layers
    seen = []
    layers[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(_local_seq(args, kwargs)),
                                        with_kwargs=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr)
    vocab = reference.get_input_embeddings().num_embeddings if hasattr(reference, "get_input_embeddings") \
        else reference.config.vocab_size
    worst: Dict[str, float] = {}

    def note(key, err):
        worst[key] = max(worst.get(key, 0.0), err)

    for step in range(steps):
        x, y = common.global_batch(step, 4, 8, vocab)
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = loss_fn(model, x, y)
            loss.backward()
        ref_loss = loss_fn(reference, x, y)
        ref_loss.backward()
        note("loss", _rel(loss, ref_loss))
        params = dict(model.named_parameters())
        for name, ref in reference.named_parameters():
            note(f"grad:{name}", _rel(params[name].grad, ref.grad))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    params = dict(model.named_parameters())
    for name, ref in reference.named_parameters():
        note(f"weight:{name}", _rel(params[name], ref))
    if len(params) != len(dict(reference.named_parameters())):
        worst["tied parameters split"] = float("inf")
    return worst, sorted(set(seen))


def _local_seq(args, kwargs) -> int:
    """The sequence length this rank holds of a decoder layer's input (its hidden states)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    return (hidden.to_local() if isinstance(hidden, DTensor) else hidden).shape[1]


def llama_parity(tp: int, sequence_parallel: bool = False, lp: bool = False, model_kw: Optional[dict] = None):
    return compare_training(llama(**(model_kw or {})), _llama_loss, tp, sequence_parallel=sequence_parallel, lp=lp)


def hf_parity(tp: int, family: str = "llama", sequence_parallel: bool = False, lp: bool = False,
              model_kw: Optional[dict] = None):
    return compare_training(hf(family, **(model_kw or {})), _hf_loss, tp, sequence_parallel=sequence_parallel, lp=lp)
