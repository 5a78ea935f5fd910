"""The Hugging Face side of ``export``: the built-in Llama as transformers' ``LlamaForCausalLM``
(its tensor names and a config.json of the same hyper-parameters), and for a run that
trained a Hugging Face model (``--model hf:DIR``), that model's config.json and tokenizer.

The built-in Llama is the same network as transformers' Llama: RMSNorm in fp32, SwiGLU
(w1 = gate, w3 = up, w2 = down), causal SDPA with grouped kv heads (head h uses kv head
h // group), and rotary embeddings that pair dimension i with i + head_dim / 2 (HF's
rotate_half), so the q and k weights need no permutation, only new names. With experts
(``num_experts`` > 0) and renormalised top-k weights it is transformers' ``MixtralForCausalLM``
(transformers 5's layout: each layer's experts as ``mlp.experts.gate_up_proj`` and ``down_proj``).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict

import torch

from ..models.llama import Llama, LlamaConfig
from .store import CheckpointError

# Built-in Llama name (within a block) -> transformers' LlamaDecoderLayer name
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    # a mixture-of-experts layer (MixtralSparseMoeBlock)
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "ffn.experts.down_proj": "mlp.experts.down_proj",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}
# What a tokenizer of a Hugging Face model directory consists of (AutoTokenizer's files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja")


def hf_name(name: str) -> str:
    """transformers' name of the built-in Llama's tensor ``name``."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_BLOCK_NAMES[rest]}"


def llama_tensors(tensors: Dict[str, torch.Tensor], config: LlamaConfig, source: str) -> Dict[str, torch.Tensor]:
    """The built-in Llama's ``tensors`` (of ``source``, for messages) under transformers' names,
    after checking they are exactly that model's at ``config``. FP8 scaling state (fp8_*
    buffers) is training state, not weights, and stays behind; a tied head is written once."""
    if config.num_experts and not config.norm_topk_prob:
        raise CheckpointError(f"{source} holds a mixture-of-experts Llama with norm_topk_prob=False, which export "
                              "cannot write: its form in transformers, Mixtral, always renormalises the top-k "
                              "weights; read its tensors with fsdp8.checkpoint.read_full_model_state instead")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Llama(config).state_dict().items()}
    if config.tie_embeddings:
        del expected["head.weight"]
    weights = {k: v for k, v in tensors.items() if not k.rsplit(".", 1)[-1].startswith("fp8_")}
    wrong = [f"{k} missing" for k in expected if k not in weights]
    wrong += [f"{k} unexpected" for k in weights if k not in expected and not (k == "head.weight" and
                                                                               config.tie_embeddings)]
    wrong += [f"{k} {list(weights[k].shape)} instead of {list(shape)}" for k, shape in expected.items()
              if k in weights and tuple(weights[k].shape) != shape]
    if wrong:
        raise CheckpointError(f"{source} does not hold the built-in Llama it names ({_describe(config)}): "
                              f"{'; '.join(wrong[:5])}{'; ...' if len(wrong) > 5 else ''}")
    return {hf_name(k): weights[k] for k in expected}


def _describe(config: LlamaConfig) -> str:
    ffn = (f"{config.num_experts} experts of {config.expert_ffn_dim} (top {config.num_experts_per_tok})"
           if config.num_experts else f"ffn {config.ffn_dim}")
    return (f"{config.n_layers} layers, dim {config.dim}, {config.n_heads} heads ({config.n_kv_heads} kv), "
            f"{ffn}, vocab {config.vocab_size}")


def llama_config_json(config: LlamaConfig, dtype: torch.dtype) -> dict:
    """A transformers config.json of the built-in Llama at ``config``, weights in ``dtype``.
    The rotary base is written both ways transformers has read it (``rope_theta`` before
    version 5, ``rope_parameters`` since). With experts, a Mixtral's."""
    dense = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "dtype": str(dtype).replace("torch.", ""),
    }
    if not config.num_experts:
        return dense
    return {**dense, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": config.expert_ffn_dim, "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok, "router_aux_loss_coef": config.router_aux_loss_coef,
            "router_jitter_noise": 0.0, "sliding_window": None}


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def hf_config(model_dir: str, dtype: torch.dtype) -> dict:
    """config.json of the Hugging Face model in ``model_dir``, its dtype set to ``dtype`` (the
    exported weights')."""
    config_file = os.path.join(model_dir, "config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the run trained --model hf:{model_dir}, whose config.json export copies, but "
                              f"{config_file} cannot be read ({e}); restore that directory") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object; restore that directory")
    config.pop("torch_dtype", None)
    config["dtype"] = str(dtype).replace("torch.", "")
    return config


def write_hf_files(model_dir: str, out: str, config: dict) -> None:
    """``config`` as ``out``/config.json, and the tokenizer files of ``model_dir`` beside it."""
    write_json(os.path.join(out, "config.json"), config)
    for name in TOKENIZER_FILES:
        source = os.path.join(model_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(out, name))
