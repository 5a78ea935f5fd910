"""Context parallelism: functions run on every rank by tests/dist/test_cp.py (module-level so workers import them).

Every run is compared with the same model trained in one process on the whole global batch.
Tokens of a sequence's first chunk come from the lowest quarter of the vocabulary and those
of its last chunk from the highest, so the embedding gradient's rows of those quarters are
the first and the last chunk's own (the chunks where masks and positions go wrong first).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import fsdp8
from fsdp8.parallel import cp
from fsdp8.parallel.tp import tensor_parallel

from . import common

SEQ = 16


def llama(**overrides) -> nn.Module:
    """A tiny built-in Llama (4 heads, 2 kv heads)."""
    from fsdp8.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32)
    return Llama(LlamaConfig(**{**fields, **overrides})).to(common.device())


def hf_llama(**overrides) -> nn.Module:
    import transformers

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides})).to(common.device())


def global_batch(step: int, rows: int, seq: int, vocab: int, n: int):
    """Tokens [rows, seq] (first chunk from the lowest vocabulary quarter, last chunk from the
    highest, the rest from the middle) and next-token targets with about a quarter ignored (-100)."""
    g = torch.Generator().manual_seed(4321 + step)
    quarter, chunk = vocab // 4, seq // (2 * n)
    tokens = torch.randint(quarter, 3 * quarter, (rows, seq), generator=g)
    tokens[:, :chunk] = torch.randint(0, quarter, (rows, chunk), generator=g)
    tokens[:, -chunk:] = torch.randint(3 * quarter, vocab, (rows, chunk), generator=g)
    targets = torch.randint(0, vocab, (rows, seq), generator=g)
    targets[torch.rand(rows, seq, generator=g) < 0.25] = cp.IGNORE_INDEX
    return tokens, targets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = (a.full_tensor() if hasattr(a, "full_tensor") else a).detach().float().cpu()
    b = b.detach().float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12)) if a.shape == b.shape else float("inf")


def _coords(mesh) -> Dict[str, int]:
    return {name: mesh[name].get_local_rank() for name in mesh.mesh_dim_names}


class _Run:
    """One model's side of a step: the batch it is fed and how its loss, logits and embedding are read."""

    def __init__(self, model: nn.Module, hf: bool):
        self.model, self.hf = model, hf
        self.logits = None
        head = model.lm_head if hf else model.head
        head.register_forward_hook(lambda m, a, out: setattr(self, "logits", out))

    def embedding(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight if self.hf else self.model.embed.weight

    def loss(self, tokens, targets, **kw):
        if self.hf:
            return self.model(**{"input_ids": tokens, "labels": targets, **kw}).loss
        return self.model(tokens, targets, **kw)


def _per_rank_quantization(reference: nn.Module, n: int) -> None:
    """Make the reference's FP8 layers quantize each cp rank's part of a sequence on its own, as
    the ranks do (a linear layer acts per token, so only the per-tensor scales change)."""
    for module in reference.modules():
        if isinstance(module, fsdp8.fp8.Float8Linear):
            whole = module.forward
            module.forward = lambda x, whole=whole: cp.unshard_tensor([whole(cp.shard_tensor(x, r, n)) for r in range(n)])


def parity(hf: bool, dp: int, n: int, tp: int = 1, sequence_parallel: bool = False, lp: bool = False,
           replicate: int = 1, fp8: bool = False, model_kw: Optional[dict] = None, steps: int = 2,
           lr: float = 0.5) -> Dict[str, float]:
    """Train at dp_replicate ``replicate`` x dp_shard ``dp`` x cp ``n`` x tp ``tp`` and in one
    process; the worst relative error of the loss, every gradient, the first and last chunk's
    logits and embedding-gradient rows, and every weight after ``steps`` SGD steps (see [Note:
    the loss over cp ranks] in fsdp8/parallel/cp.py for why each rank's loss is divided by
    loss_divisor). Also checks that fully_shard shards over dp_shard x cp.

    ``lp``: tensor parallelism leaves the logits vocabulary-sharded and the loss runs under
    torch's loss_parallel(). ``fp8``: FP8 current scaling, against the same recipe in one
    process with each rank's part quantized separately, in lockstep (the reference takes the
    sharded run's weights before every step: common.lockstep_errors says why)."""
    mesh = fsdp8.make_mesh(dp_replicate=replicate, dp_shard=dp, cp=n, tp=tp)
    fp8_dims = dict(n_heads=2, n_kv_heads=1, ffn_dim=64) if fp8 else {}
    model = hf_llama(**(model_kw or {})) if hf else llama(**{**fp8_dims, **(model_kw or {})})
    reference = copy.deepcopy(model)
    recipe = fsdp8.Float8CurrentScaling() if fp8 else None
    if fp8:
        for layer in reference.layers:
            fsdp8.convert_to_fp8(layer, recipe)
        _per_rank_quantization(reference, n)
    if tp > 1:
        tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=lp)
    cp.context_parallel(model, mesh, sequence_parallel=sequence_parallel)
    sharded = fsdp8.fully_shard(model, mesh=mesh, fp8=recipe)
    names = next(iter(sharded.parameters())).device_mesh.mesh_dim_names
    shards = next(iter(sharded.parameters())).device_mesh.shape[names.index("dp_shard_cp")]
    assert shards == dp * n, f"main weights on {names}, {shards} shards"
    run, ref = _Run(sharded, hf), _Run(reference, hf)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=lr) for m in (sharded, reference))
    vocab = reference.config.vocab_size
    where = _coords(mesh)
    dp_rank, cp_rank = where.get("dp_replicate", 0) * dp + where.get("dp_shard", 0), where["cp"]
    dp *= replicate
    worst: Dict[str, float] = {}

    def note(key, err):
        worst[key] = max(worst.get(key, 0.0), err)

    for step in range(steps):
        if fp8:
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    p.copy_(dict(sharded.named_parameters())[name].full_tensor())
        tokens, targets = global_batch(step, 2 * dp, SEQ, vocab, n)
        if hf:  # Hugging Face takes unshifted labels: the inputs with some positions ignored
            targets = torch.where(targets == cp.IGNORE_INDEX, targets, tokens)
        keys = ("input_ids", "labels") if hf else ("tokens", "targets")
        rows = slice(2 * dp_rank, 2 * dp_rank + 2)
        batch = {k: t[rows].to(common.device()) for k, t in zip(keys, (tokens, targets))}
        batch = cp.shard_sequence(batch, mesh, sequence_parallel=sequence_parallel)
        divisor = cp.loss_divisor(batch["labels" if hf else "targets"], mesh)
        with loss_parallel() if lp else contextlib.nullcontext():
            if hf:
                loss = sharded(**batch, num_items_in_batch=divisor).loss
            else:
                loss = sharded(batch["tokens"], batch["targets"], num_items_in_batch=divisor)
            loss.backward()
        ref_loss = ref.loss(tokens.to(common.device()), targets.to(common.device()))
        ref_loss.backward()

        # The global loss is the ranks' mean; each rank's logits are its rows' part of the sequence.
        pieces: List = [None] * dist.get_world_size()
        logits = run.logits.full_tensor() if isinstance(run.logits, DTensor) else run.logits
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        dist.all_gather_object(pieces, (where.get("tp", 0), dp_rank, cp_rank, float(loss), logits.detach().cpu()))
        losses = [p[3] for p in pieces if p[0] == 0]
        note("loss", abs(sum(losses) / len(losses) - float(ref_loss)) / abs(float(ref_loss)))
        parts = {(d, c): logits for t, d, c, _, logits in pieces if t == 0}
        logits = torch.cat([cp.unshard_tensor([parts[d, c] for c in range(n)]) for d in range(dp)])
        chunk = SEQ // (2 * n)
        note("logits, first chunk", _rel(logits[:, :chunk], ref.logits[:, :chunk]))
        note("logits, last chunk", _rel(logits[:, -chunk:], ref.logits[:, -chunk:]))
        grads = {name: p.grad for name, p in sharded.named_parameters()}
        for name, p in reference.named_parameters():
            note(f"grad:{name}", _rel(grads[name], p.grad))
        embed, ref_embed = run.embedding().grad.full_tensor(), ref.embedding().grad
        quarter = vocab // 4
        note("embedding grad, first chunk's rows", _rel(embed[:quarter], ref_embed[:quarter]))
        note("embedding grad, last chunk's rows", _rel(embed[-quarter:], ref_embed[-quarter:]))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    params = dict(sharded.named_parameters())
    for name, p in reference.named_parameters():
        note(f"weight:{name}", _rel(params[name], p))
    return worst


# -- bad input ------------------------------------------------------------------------------------
def _mesh(tp: int = 1):
    return fsdp8.make_mesh(dp_shard=1, cp=common.world() // tp, tp=tp)


def _hf_family(family: str, **overrides) -> nn.Module:
    import transformers

    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, attn_implementation="sdpa")
    config = getattr(transformers, f"{family}Config")(**{**fields, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def _hf_without_registry() -> nn.Module:
    import transformers

    class OldStyleLlama(transformers.LlamaForCausalLM):
        _supports_attention_backend = False

    return OldStyleLlama(hf_llama().config)


def _hf_not_causal() -> nn.Module:
    model = hf_llama()
    model.model.layers[1].self_attn.is_causal = False
    return model


def _cp(build, mesh, sequence_parallel: bool = False) -> nn.Module:
    """``build()`` made context-parallel over ``mesh`` (tensor-parallel first when sequence-parallel)."""
    model = build()
    if sequence_parallel:
        tensor_parallel(model, mesh["tp"], sequence_parallel=True)
    return cp.context_parallel(model, mesh, sequence_parallel=sequence_parallel)


def _hf_batch(seq: int = SEQ, **extra):
    tokens, _ = global_batch(0, 2, seq, 128, 2)
    return {"input_ids": tokens, **extra}


def _ids(seq: int) -> torch.Tensor:
    return torch.zeros(2, seq, dtype=torch.long)


# name -> what to do with the mesh (cp 2, or cp 2 x tp 2 for the sp_ names)
BAD_INPUTS = {
    "not_a_known_model": lambda mesh: cp.context_parallel(nn.Sequential(nn.Linear(4, 4)), mesh),
    "mesh_without_cp": lambda mesh: cp.context_parallel(llama(), fsdp8.make_mesh()),
    "llama_twice": lambda mesh: cp.context_parallel(_cp(llama, mesh), mesh),
    "odd_sequence": lambda mesh: cp.shard_sequence({"tokens": _ids(6)}, mesh),
    "odd_local_tokens": lambda mesh: _cp(llama, mesh)(_ids(3)),
    "longer_than_max_seq_len": lambda mesh: _cp(lambda: llama(max_seq_len=8), mesh)(_ids(8)),
    "padding_mask": lambda mesh: cp.shard_sequence(_hf_batch(attention_mask=torch.tensor([[1] * 15 + [0]] * 2)), mesh),
    "unknown_key": lambda mesh: cp.shard_sequence(_hf_batch(token_type_ids=torch.zeros(2, SEQ)), mesh),
    "hf_twice": lambda mesh: cp.context_parallel(_cp(hf_llama, mesh), mesh),
    "hf_without_registry": lambda mesh: _cp(_hf_without_registry, mesh),
    "hf_not_causal": lambda mesh: _cp(_hf_not_causal, mesh),
    "hf_softcap": lambda mesh: _cp(lambda: _hf_family("Gemma2", attn_logit_softcapping=50.0,
                                                      attn_implementation="eager"), mesh),
    "hf_sliding_window": lambda mesh: _cp(lambda: _hf_family("Mistral", sliding_window=4), mesh)(
        **cp.shard_sequence(_hf_batch(), mesh)),
    "hf_attention_mask": lambda mesh: _cp(hf_llama, mesh)(input_ids=_ids(8), attention_mask=torch.ones(2, 8)),
    "hf_unshifted_labels": lambda mesh: _cp(hf_llama, mesh)(input_ids=_ids(8), labels=_ids(8)),
    "hf_positional": lambda mesh: _cp(hf_llama, mesh)(_ids(8), None),
    "sp_without_tp": lambda mesh: cp.context_parallel(llama(), mesh, sequence_parallel=True),
    "sp_sequence": lambda mesh: cp.shard_sequence({"tokens": _ids(6)}, mesh, sequence_parallel=True),
    "sp_local_tokens": lambda mesh: _cp(llama, mesh, sequence_parallel=True)(_ids(3)),
}


def bad_input(name: str, tp: int = 1):
    """(the error message or None, how many cp key/value gathers ran before it) for BAD_INPUTS[name]."""
    mesh = _mesh(tp)
    gathers = []
    original = cp._gather
    cp._gather = lambda *a: gathers.append(1) or original(*a)
    try:
        BAD_INPUTS[name](mesh)
        message = None
    except (ValueError, TypeError) as e:
        message = str(e)
    finally:
        cp._gather = original
    return message, len(gathers)
