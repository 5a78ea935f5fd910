"""The built-in reference model: a plain Llama (RMSNorm, rotary, GQA attention, SwiGLU), or with
mixture-of-experts feed-forward layers (moe.py) when ``num_experts`` > 0."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from .moe import Experts, MoE

_IGNORE_INDEX = -100  # F.cross_entropy's: targets that count for no loss


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    checkpoint_activations: bool = False
    # Mixture of experts (0 experts: every feed-forward layer dense). With experts, every layer's
    # feed-forward is an MoE of num_experts SwiGLU experts of moe_ffn_dim (0: ffn_dim), each
    # token routed to num_experts_per_tok of them.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_ffn_dim: int = 0
    router_aux_loss_coef: float = 0.001
    norm_topk_prob: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads} "
                "(each kv head serves a whole group of query heads)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even for rotary embeddings"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        for name in ("num_experts", "moe_ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LlamaConfig.{name} must be an int >= 0, got {value!r}")
        k = self.num_experts_per_tok
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"LlamaConfig.num_experts_per_tok must be a positive int, got {k!r}")
        if self.num_experts and k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={k} routes each token to more experts than the "
                             f"num_experts={self.num_experts} there are; pass num_experts_per_tok <= "
                             f"{self.num_experts}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"LlamaConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"LlamaConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        """Each expert's hidden size."""
        return self.moe_ffn_dim or self.ffn_dim


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                        ffn_dim=384, max_seq_len=256),
    "small": LlamaConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                         ffn_dim=1536, max_seq_len=1024),
    "1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, max_seq_len=2048),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0),
    # Mixtures of experts. "moe-tiny": "tiny" with 8 experts of 128 (top-2) per layer, 1.84 M parameters
    # (0.66 M active per token). "moe-1b": 16 layers of 1024, 64 experts of 256 (top-8) each, 0.91 B
    # parameters (0.21 B active per token).
    "moe-tiny": LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
                            max_seq_len=256, num_experts=8, num_experts_per_tok=2, moe_ffn_dim=128),
    "moe-1b": LlamaConfig(vocab_size=32000, dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim=256,
                          max_seq_len=2048, num_experts=64, num_experts_per_tok=8, moe_ffn_dim=256),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """The named preset config, with any fields in `overrides` replaced (and re-validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown Llama preset {name!r}; valid names: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# [Note: initialisation lives in leaf modules only]
# A model built on the meta device is materialised by calling reset_parameters() on each
# module that directly owns a meta tensor, in model.modules() order. So every random draw
# happens in the reset_parameters() of the module that owns the parameter, and no parent
# defines one: a parent re-initialising its children would draw twice, and a tied head
# would overwrite the embedding it shares.


def _in_loss_parallel() -> bool:
    """Whether torch's loss_parallel() is active: it installs DTensor handlers for the
    log-softmax it parallelises. A torch that keeps them elsewhere is given the benefit
    of the doubt (its own error then names the mixed Tensor/DTensor call)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    return handlers is None or torch.ops.aten._log_softmax.default in handlers


class Linear(nn.Linear):
    """Bias-free linear layer initialised from normal(0, std)."""

    def __init__(self, in_features: int, out_features: int, std: float):
        self.std = std  # nn.Linear.__init__ calls reset_parameters, which needs it
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and self.weight.dtype == torch.bfloat16:
            # A bf16 GEMM is exact products summed in fp32 and rounded once to bf16: the fp32
            # GEMM of the same values does that too. On CPUs without bf16 units (AVX2) torch's
            # bf16 GEMM is ~20x slower than its fp32 one (71 vs 3 ms for 512x128x512, fwd+bwd).
            return F.linear(x.float(), self.weight.float()).to(torch.bfloat16)
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, std={self.std:.3g}"


class Embedding(nn.Embedding):
    """Token embedding initialised from normal(0, std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float):
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, std={self.std:.3g}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares overflows or loses precision in bf16/fp16.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Rotary(nn.Module):
    """cos/sin tables for rotary position embeddings, [max_seq_len, head_dim / 2]."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        # Non-persistent: derived from the config, so checkpoints need not carry them.
        shape = (max_seq_len, head_dim // 2)
        self.register_buffer("cos", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        )
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int, dtype: torch.dtype,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of positions 0..seq_len-1, or of ``positions`` [seq_len] when given."""
        if positions is not None:
            return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}")
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by position.

    Pairs dimension i with i + head_dim/2 (the Hugging Face layout), so HF Llama weights
    load without permuting wq and wk.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of q [batch, heads, seq, head_dim] over k, v [batch, kv_heads, seq, head_dim]."""
    if k.shape[1] != q.shape[1]:
        # Explicit expansion rather than SDPA's enable_gqa: every backend supports it.
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        std, out_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = Linear(config.dim, config.dim, std)
        self.wk = Linear(config.dim, kv_dim, std)
        self.wv = Linear(config.dim, kv_dim, std)
        self.wo = Linear(config.dim, config.dim, out_std)
        # (q, k, v) -> output; context parallelism swaps in its attention over the cp group's
        # whole sequences (llama_adapter.py).
        self.attend = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv yield this rank's heads only.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.attend(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        std, out_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)
        self.w1 = Linear(config.dim, config.ffn_dim, std)
        self.w3 = Linear(config.dim, config.ffn_dim, std)
        self.w2 = Linear(config.ffn_dim, config.dim, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.checkpoint_activations = config.checkpoint_activations
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = MoE(config) if config.num_experts else FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The block's output; with an MoE feed-forward, (the output, its load-balancing loss)."""
        if self.checkpoint_activations:
            # Non-reentrant: works with hooks and with inputs that do not require grad.
            return checkpoint(self._body, x, cos, sin, use_reentrant=False)
        return self._body(x, cos, sin)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        h = x + self.attn(self.attn_norm(x), cos, sin)
        if isinstance(self.ffn, MoE):
            # Returned, not kept on the module: under checkpointing the recomputation's aux loss
            # goes nowhere, so each layer's counts once.
            out, aux_loss = self.ffn(self.ffn_norm(h))
            return h + out, aux_loss
        return h + self.ffn(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.dim, config.init_std)
        self.rotary = Rotary(config.head_dim, config.max_seq_len, config.rope_theta)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.head = Linear(config.dim, config.vocab_size, config.init_std)
        if config.tie_embeddings:
            # head comes after embed in modules() order, so materialisation skips it.
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None,
                num_items_in_batch: float | torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab], or the cross-entropy loss when targets are given.

        ``positions`` [seq]: the tokens' positions in their sequences (default 0..seq-1;
        context parallelism fills in this rank's). The loss is the mean over the targets
        that are not -100, or with ``num_items_in_batch`` (as Hugging Face's loss keyword)
        their sum divided by it (fsdp8.parallel.cp.loss_divisor gives the divisor that
        makes the ranks' average the global batch's token mean).

        With experts, the loss adds ``router_aux_loss_coef`` x the sum over the layers of each
        layer's load-balancing loss on this call's tokens (moe.load_balancing_loss: 1 when
        balanced). With ``num_items_in_batch`` that term is weighted like the cross-entropy, by
        this call's counted targets / ``num_items_in_batch``, so the calls whose losses add up to
        a step's add up to its token-weighted mean of the aux loss too."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        x = self.embed(tokens)
        cos, sin = self.rotary(tokens.shape[1], x.dtype, positions)
        aux_losses = []
        for layer in self.layers:
            x = layer(x, cos, sin)
            if isinstance(x, tuple):
                x, aux_loss = x
                aux_losses.append(aux_loss)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        if isinstance(logits, DTensor) and logits.placements[-1].is_shard() and not _in_loss_parallel():
            raise RuntimeError(
                "the logits are vocabulary-sharded (tensor_parallel(..., loss_parallel=True)): compute the loss "
                "and call backward() inside torch.distributed.tensor.parallel.loss_parallel()"
            )
        # Under loss_parallel() a vocabulary-sharded DTensor goes through torch's
        # vocabulary-parallel cross-entropy: no rank gathers the full logits.
        flat_logits, flat_targets = logits.float().flatten(0, 1), targets.flatten()
        if num_items_in_batch is None:
            loss = F.cross_entropy(flat_logits, flat_targets)
        else:
            loss = F.cross_entropy(flat_logits, flat_targets, reduction="sum") / num_items_in_batch
        return loss + self._aux_term(aux_losses, targets, num_items_in_batch) if aux_losses else loss

    def _aux_term(self, aux_losses: list[torch.Tensor], targets: torch.Tensor,
                  num_items_in_batch: float | torch.Tensor | None) -> torch.Tensor:
        """The layers' load-balancing losses in the loss, weighted as ``forward`` says."""
        aux = self.config.router_aux_loss_coef * torch.stack(aux_losses).sum()
        if num_items_in_batch is None:
            return aux
        return aux * (targets != _IGNORE_INDEX).sum() / num_items_in_batch

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Number of distinct parameters; a tied head counts once, as the embedding."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.embed.weight.numel()
        return n

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """``num_params`` less the experts a token does not run: of each MoE layer's
        ``num_experts`` experts, ``num_experts_per_tok`` count (all of a dense model's count)."""
        c = self.config
        experts = sum(p.numel() for m in self.modules() if isinstance(m, Experts) for p in m.parameters())
        unused = experts // c.num_experts * (c.num_experts - c.num_experts_per_tok) if c.num_experts else 0
        return self.num_params(exclude_embedding) - unused

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 * N + 12 * n_layers * dim * seq_len.

        N counts the parameters a token's matmuls use (all but the embedding table, counting
        the head even when tied; of the experts, those it is routed to: ``num_active_params``);
        6 = forward (2) + backward (4) per multiply-add. The second term is attention scores
        and values, counted as if not causal (the PaLM convention used for MFU).
        """
        c = self.config
        n = self.num_active_params(exclude_embedding=True) + (c.vocab_size * c.dim if c.tie_embeddings else 0)
        return 6 * n + 12 * c.n_layers * c.dim * seq_len
