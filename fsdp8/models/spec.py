"""A Llama-family decoder by its sizes (ModelSpec): what the planner computes with and what a model
adapter describes a model as (adapter.py ``planner_spec``), read from the built-in Llama's config or
a Hugging Face config.

Here, below the planner, because adapters must build it and the planner uses it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Tuple

# Hugging Face model types whose decoder layer is the Llama block (RMSNorm, rotary GQA
# attention, SwiGLU), and what they add to it.
HF_TYPES = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder by its sizes. ``family`` says whose code runs it: ``"fsdp8"``
    (fsdp8.models.llama) or ``"hf"`` (transformers), whose norms keep different tensors."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    family: str = "fsdp8"

    def __post_init__(self):
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(f"model {self.name!r}: hidden={self.hidden} is not divisible by heads={self.heads}; "
                             "give head_dim")
        if self.family not in ("fsdp8", "hf"):
            raise ValueError(f"model family {self.family!r}: use 'fsdp8' or 'hf'")

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.hd

    def block_params(self) -> List["Param"]:
        """One decoder layer's parameters (their order does not change any size)."""
        d, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.ffn
        params = [Param("attn_norm", (d,)), Param("wq", (q, d), "col", True), Param("wk", (kv, d), "col", True),
                  Param("wv", (kv, d), "col", True), Param("wo", (d, q), "row", True), Param("ffn_norm", (d,)),
                  Param("w1", (f, d), "col", True), Param("w3", (f, d), "col", True), Param("w2", (d, f), "row", True)]
        if self.qkv_bias:
            params += [Param("bq", (q,), "col"), Param("bk", (kv,), "col"), Param("bv", (kv,), "col")]
        if self.qk_norm:
            params += [Param("q_norm", (self.hd,)), Param("k_norm", (self.hd,))]
        return params

    def root_params(self) -> List["Param"]:
        """What stays outside the units: embedding, final norm, head (one parameter when tied)."""
        params = [Param("embed", (self.vocab, self.hidden), "col"), Param("norm", (self.hidden,))]
        return params if self.tied else params + [Param("head", (self.vocab, self.hidden), "col")]

    @property
    def num_params(self) -> int:
        block = sum(math.prod(p.shape) for p in self.block_params())
        return self.layers * block + sum(math.prod(p.shape) for p in self.root_params())

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs per token, as fsdp8.models.llama counts them for MFU: 6 x the parameters
        used in matmuls (all but the embedding; the head even when tied) + 12 L Dq S (attention
        scores and values, counted as if not causal)."""
        matmul = self.num_params - self.vocab * self.hidden + (self.vocab * self.hidden if self.tied else 0)
        return 6 * matmul + 12 * self.layers * self.q_dim * seq_len

    def describe(self) -> str:
        extra = "".join([", tied" if self.tied else "", ", qkv bias" if self.qkv_bias else "",
                         ", qk norm" if self.qk_norm else ""])
        return (f"{self.name} ({self.num_params / 1e9:.2f} B params: {self.layers} layers, hidden {self.hidden}, "
                f"ffn {self.ffn}, {self.heads}/{self.kv_heads} heads of {self.hd}, vocab {self.vocab}{extra})")


@dataclass(frozen=True)
class Param:
    """A parameter's global shape and how tensor parallelism places it: ``col`` splits dim 0
    (colwise linears, the vocabulary-sharded embedding), ``row`` dim 1 (rowwise linears),
    ``rep`` none (fsdp8/models/llama_adapter.py llama_plan). ``linear``: the weight of a
    linear layer inside a unit, which FP8 may convert."""

    name: str
    shape: Tuple[int, ...]
    tp: str = "rep"
    linear: bool = False


def hf_spec_of(config: dict, name: str = "", where: str = "the model's config") -> ModelSpec:
    """A ModelSpec from a Hugging Face config as a dict (config.json, or ``config.to_dict()``);
    ``where`` names it in errors."""
    config = config.get("text_config", config)
    if "model_type" not in config:
        raise ValueError(f"{where} has no 'model_type'; give the sizes with --layers --hidden --ffn --heads --vocab "
                         "instead")
    kind = config["model_type"]
    if kind not in HF_TYPES:
        raise ValueError(f"{where}: model_type {kind!r} is not a Llama-family decoder the planner knows "
                         f"({', '.join(HF_TYPES)}); give the sizes with --layers --hidden --ffn --heads --vocab instead")
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [field for field in required if field not in config]
    if missing:
        raise ValueError(f"{where} has no {', '.join(map(repr, missing))}")
    sizes = {field: config[field] for field in required}
    # Without these two (or with null), the others give them.
    sizes.update({field: config[field] for field in ("num_key_value_heads", "head_dim") if config.get(field) is not None})
    for field, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} is {value!r}, not a positive integer")
    heads = sizes["num_attention_heads"]
    spec = ModelSpec(
        name=name or kind, layers=sizes["num_hidden_layers"], hidden=sizes["hidden_size"],
        ffn=sizes["intermediate_size"], heads=heads, kv_heads=sizes.get("num_key_value_heads", heads),
        vocab=sizes["vocab_size"], head_dim=sizes.get("head_dim", 0),
        tied=bool(config.get("tie_word_embeddings", False)), qkv_bias=bool(config.get("attention_bias", False)),
        family="hf")
    return replace(spec, **HF_TYPES[kind])


def llama_spec(config, name: str) -> ModelSpec:
    """The ModelSpec of the built-in Llama with ``config`` (its LlamaConfig); a mixture of experts
    has none yet (a ModelSpec's layer is dense)."""
    c = config
    if c.num_experts:
        raise ValueError(f"the planner does not know mixture-of-experts models yet ({name}: {c.num_experts} experts "
                         "per layer); choose the layout yourself: pass a fsdp8.ParallelConfig (fsdp8 train: the "
                         "layout flags)")
    return ModelSpec(name, c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.vocab_size, tied=c.tie_embeddings)
