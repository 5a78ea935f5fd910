"""A Llama-family decoder by its sizes (ModelSpec): what the planner computes with and what a model
adapter describes a model as (adapter.py ``planner_spec``), read from the built-in Llama's config or
a Hugging Face config. Its layers are dense (a SwiGLU MLP) or mixtures of experts (a router and
``experts`` SwiGLU experts, ``experts_per_token`` of them run per token).

Here, below the planner, because adapters must build it and the planner uses it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Tuple

# Hugging Face model types whose decoder layer is the Llama block (RMSNorm, rotary GQA
# attention, SwiGLU), and what they add to it.
HF_TYPES = {"llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
            "qwen3_moe": {"qk_norm": True}, "mixtral": {}}
# Mixtures of experts among them: the config fields counting the experts (the first present:
# Qwen3-MoE's config.json says num_experts, transformers 5.2x writes num_local_experts for both)
# and giving their width (Mixtral's experts are its intermediate_size wide; Qwen3-MoE's dense
# layers are, its experts moe_intermediate_size).
HF_EXPERTS = {"qwen3_moe": (("num_experts", "num_local_experts"), "moe_intermediate_size"),
              "mixtral": (("num_local_experts", "num_experts"), "intermediate_size")}


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder by its sizes. ``family`` says whose code runs it: ``"fsdp8"``
    (fsdp8.models.llama) or ``"hf"`` (transformers), whose norms keep different tensors.

    With ``experts`` > 0 a layer's MLP is a mixture of experts: a router [experts, hidden] and
    ``experts`` SwiGLU experts of width ``expert_ffn`` (models/moe.py's ``gate_up_proj``
    [E, 2I, H] and ``down_proj`` [E, H, I]), each token run through ``experts_per_token`` of
    them. Which layers: layer i (from 0) when ``(i + 1) % moe_step == 0`` and i is not in
    ``dense_layers`` (Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``); the others
    keep the dense MLP of width ``ffn``."""

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
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    moe_step: int = 1
    dense_layers: Tuple[int, ...] = ()

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
        self._check_experts()

    def _check_experts(self) -> None:
        fields = ("experts", "experts_per_token", "expert_ffn")
        for name in fields:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {name} must be an int >= 0, got {value!r}")
        if not self.experts:
            if self.experts_per_token or self.expert_ffn:
                raise ValueError(f"model {self.name!r}: experts_per_token and expert_ffn size experts; a dense model "
                                 "(experts=0) has none")
            return
        if not 1 <= self.experts_per_token <= self.experts or not self.expert_ffn:
            raise ValueError(f"model {self.name!r}: {self.experts} experts need 1 <= experts_per_token <= "
                             f"{self.experts} (got {self.experts_per_token}) and expert_ffn > 0 "
                             f"(got {self.expert_ffn})")
        if isinstance(self.moe_step, bool) or not isinstance(self.moe_step, int) or self.moe_step < 1:
            raise ValueError(f"model {self.name!r}: moe_step must be a positive int, got {self.moe_step!r}")
        if not isinstance(self.dense_layers, tuple) or not all(isinstance(i, int) for i in self.dense_layers):
            raise ValueError(f"model {self.name!r}: dense_layers must be a tuple of layer indices, got "
                             f"{self.dense_layers!r}")

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.hd

    # -- which layers are mixtures of experts ---------------------------------------------------
    def is_moe(self, layer: int) -> bool:
        return bool(self.experts) and (layer + 1) % self.moe_step == 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers are mixtures of experts."""
        return sum(self.is_moe(i) for i in range(self.layers))

    def layer_kind(self, layer: int) -> str:
        return "moe" if self.is_moe(layer) else "dense"

    def layer_kinds(self) -> List[Tuple[str, int]]:
        """(kind, how many layers of it): ``"dense"`` and ``"moe"``, those present, the first
        layer's first."""
        counts = {"dense": self.layers - self.moe_layers, "moe": self.moe_layers}
        order = sorted(counts, key=lambda kind: kind != self.layer_kind(0))
        return [(kind, counts[kind]) for kind in order if counts[kind]]

    # -- parameters ------------------------------------------------------------------------------
    def _attention_params(self) -> List["Param"]:
        d, q, kv = self.hidden, self.q_dim, self.kv_dim
        return [Param("attn_norm", (d,)), Param("wq", (q, d), "col", True), Param("wk", (kv, d), "col", True),
                Param("wv", (kv, d), "col", True), Param("wo", (d, q), "row", True), Param("ffn_norm", (d,))]

    def _attention_extras(self) -> List["Param"]:
        q, kv = self.q_dim, self.kv_dim
        params = [Param("bq", (q,), "col"), Param("bk", (kv,), "col"), Param("bv", (kv,), "col")] \
            if self.qkv_bias else []
        return params + ([Param("q_norm", (self.hd,)), Param("k_norm", (self.hd,))] if self.qk_norm else [])

    def block_params(self) -> List["Param"]:
        """One dense decoder layer's parameters (their order does not change any size)."""
        d, f = self.hidden, self.ffn
        mlp = [Param("w1", (f, d), "col", True), Param("w3", (f, d), "col", True), Param("w2", (d, f), "row", True)]
        return self._attention_params() + mlp + self._attention_extras()

    def moe_block_params(self) -> List["Param"]:
        """One mixture-of-experts layer's parameters but its experts: attention, norms, the router
        (a parameter, not a linear layer: FP8 keeps it in high precision)."""
        return self._attention_params() + [Param("router", (self.experts, self.hidden))] + self._attention_extras()

    def expert_params(self) -> List["Param"]:
        """One mixture-of-experts layer's experts, in transformers' layout (models/moe.py); under FP8
        their grouped GEMMs run in FP8 and their weights gather as FP8 bytes where they convert
        (planner/model.py gathers_fp8_experts)."""
        e, d, i = self.experts, self.hidden, self.expert_ffn
        return [Param("gate_up_proj", (e, 2 * i, d), expert=True), Param("down_proj", (e, d, i), expert=True)]

    def root_params(self) -> List["Param"]:
        """What stays outside the units: embedding, final norm, head (one parameter when tied)."""
        params = [Param("embed", (self.vocab, self.hidden), "col"), Param("norm", (self.hidden,))]
        return params if self.tied else params + [Param("head", (self.vocab, self.hidden), "col")]

    def _params(self, active: bool) -> int:
        dense, moe = self.layers - self.moe_layers, self.moe_layers
        total = dense * _numel(self.block_params()) + _numel(self.root_params())
        if moe:
            experts = _numel(self.expert_params())
            if active:  # each token runs k of the E experts
                experts = experts // self.experts * self.experts_per_token
            total += moe * (_numel(self.moe_block_params()) + experts)
        return total

    @property
    def num_params(self) -> int:
        return self._params(active=False)

    @property
    def num_active_params(self) -> int:
        """The parameters one token's forward uses: ``num_params`` less the experts it is not
        routed to (of each MoE layer's ``experts``, ``experts_per_token`` count)."""
        return self._params(active=True)

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs per token, as fsdp8.models.llama counts them for MFU: 6 x the parameters
        used in matmuls (all active ones but the embedding; the head even when tied) + 12 L Dq S
        (attention scores and values, counted as if not causal)."""
        matmul = self.num_active_params - self.vocab * self.hidden + (self.vocab * self.hidden if self.tied else 0)
        return 6 * matmul + 12 * self.layers * self.q_dim * seq_len

    def describe(self) -> str:
        extra = "".join([", tied" if self.tied else "", ", qkv bias" if self.qkv_bias else "",
                         ", qk norm" if self.qk_norm else ""])
        if not self.experts:
            return (f"{self.name} ({self.num_params / 1e9:.2f} B params: {self.layers} layers, hidden {self.hidden}, "
                    f"ffn {self.ffn}, {self.heads}/{self.kv_heads} heads of {self.hd}, vocab {self.vocab}{extra})")
        moe = self.moe_layers
        experts = f"{self.experts} experts of {self.expert_ffn} (top {self.experts_per_token})"
        layers = (f"each a mixture of {experts}" if moe == self.layers else
                  f"{moe} of them mixtures of {experts}, the other {self.layers - moe} dense with ffn {self.ffn}")
        return (f"{self.name} ({self.num_params / 1e9:.2f} B params, {self.num_active_params / 1e9:.2f} B active per "
                f"token: {self.layers} layers, {layers}, hidden {self.hidden}, {self.heads}/{self.kv_heads} heads of "
                f"{self.hd}, vocab {self.vocab}{extra})")


def _numel(params: List["Param"]) -> int:
    return sum(math.prod(p.shape) for p in params)


@dataclass(frozen=True)
class Param:
    """A parameter's global shape and how tensor parallelism places it: ``col`` splits dim 0
    (colwise linears, the vocabulary-sharded embedding), ``row`` dim 1 (rowwise linears),
    ``rep`` none (fsdp8/models/llama_adapter.py llama_plan). ``linear``: the weight of a
    linear layer inside a unit, which FP8 may convert. ``expert``: dim 0 counts experts, which
    expert parallelism splits over the ep ranks (fsdp8/parallel/ep.py)."""

    name: str
    shape: Tuple[int, ...]
    tp: str = "rep"
    linear: bool = False
    expert: bool = False


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
        family="hf", **(_hf_experts(config, kind, where) if kind in HF_EXPERTS else {}))
    return replace(spec, **HF_TYPES[kind])


def _hf_experts(config: dict, kind: str, where: str) -> dict:
    """The ModelSpec's expert fields of a Qwen3-MoE or Mixtral config (none when it has no experts):
    transformers makes layer i a mixture of experts when i is not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0`` (Qwen3MoeDecoderLayer; Mixtral's are all)."""
    counts, width_field = HF_EXPERTS[kind]
    count_field = next((field for field in counts if config.get(field) is not None), counts[0])
    count = config.get(count_field)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{where}: {count_field} is {count!r}, not an integer >= 0")
    if not count:
        return {}
    fields = {"num_experts_per_tok": config.get("num_experts_per_tok"), width_field: config.get(width_field),
              "decoder_sparse_step": config.get("decoder_sparse_step", 1)}
    for field, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} is {value!r}, not a positive integer")
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"{where}: mlp_only_layers is {dense!r}, not a list of layer indices")
    return dict(experts=count, experts_per_token=fields["num_experts_per_tok"],
                expert_ffn=fields[width_field], moe_step=fields["decoder_sparse_step"],
                dense_layers=tuple(sorted(dense)))


def llama_spec(config, name: str) -> ModelSpec:
    """The ModelSpec of the built-in Llama with ``config`` (its LlamaConfig): with experts, every
    layer a mixture of them."""
    c = config
    experts = dict(experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
                   expert_ffn=c.expert_ffn_dim) if c.num_experts else {}
    return ModelSpec(name, c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.vocab_size, tied=c.tie_embeddings,
                     **experts)
