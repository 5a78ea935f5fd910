"""Context parallelism for Hugging Face models: cp attention through transformers' attention-function registry.

A model whose attention calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
(``_supports_attention_backend``; transformers >= 4.48) gets fsdp8's context-parallel
attention by registering it under a name of its own and selecting that name. What differs
between the transformers versions fsdp8 supports:

- registering: ``transformers.AttentionInterface.register`` (>= 4.51); in 4.50 the registry
  is the plain dict ``modeling_utils.ALL_ATTENTION_FUNCTIONS``.
- selecting: ``model.set_attn_implementation`` (>= 4.54 and 5.x); before, the config's
  ``_attn_implementation`` setter.
- masks: from 4.53 (``masking_utils``) a name with no mask function registered in
  ``AttentionMaskInterface`` gets no mask at all, so no dense causal mask is built; 4.50 to
  4.52 build one ``[batch, 1, seq/cp, seq/cp + 1]`` mask per forward that this attention
  ignores (it applies causality at global positions itself).
- the loss: ``ForCausalLMLoss`` takes ``shift_labels`` (labels already shifted: used as
  they are) and ``num_items_in_batch`` (the summed loss divided by it) from 4.50 on and in
  5.x; ``shard_sequence`` and ``loss_divisor`` produce both.
"""

from __future__ import annotations

import itertools

import torch.nn as nn

_names = itertools.count()


def _check_attention(model: nn.Module) -> None:
    """Raise unless every attention of ``model`` goes through the registry and is plain causal
    attention over whole sequences (what the cp attention computes)."""
    import transformers

    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{name}'s attention does not go through transformers' attention-function registry "
            f"(_supports_attention_backend is False in transformers {transformers.__version__}), so context "
            "parallelism cannot replace it; use a transformers version where it does, or a model family that does"
        )
    not_causal = [n for n, m in model.named_modules() if getattr(m, "is_causal", True) is False]
    if not_causal:
        raise ValueError(
            f"{name} has non-causal attention ({not_causal[0]}, ...): context parallelism splits causal "
            "attention only (decoder LMs)"
        )
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"{name} caps its attention logits (attn_logit_softcapping={softcap}), which SDPA, and so the "
            "context-parallel attention, does not do; set config.attn_logit_softcapping=None to train without it"
        )


def _hf_attention(context):
    """The registry function: transformers' ``(module, query, key, value, attention_mask,
    scaling=None, dropout=0.0, **kwargs) -> (output [b, seq, heads, d], weights)``."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        seq_len = query.shape[-2] * context.cp
        window = kwargs.get("sliding_window")
        if window is not None and window < seq_len:
            raise ValueError(
                f"{type(module).__name__} has a sliding window of {window} tokens, shorter than the sequences "
                f"({seq_len}); the context-parallel attention attends to the whole causal prefix: train on "
                f"sequences of at most {window} tokens or without the window (config.sliding_window=None)"
            )
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            raise ValueError(
                f"{type(module).__name__} passes {'softcap' if kwargs.get('softcap') is not None else 'attention sinks'} "
                "to its attention, which the context-parallel attention does not compute"
            )
        if kwargs.get("is_causal") is False:
            raise ValueError(f"{type(module).__name__} asks for non-causal attention; context parallelism is causal only")
        # attention_mask is ignored: from transformers 4.53 it is None here; before, the
        # model's own dense causal mask over this rank's tokens, whose order it does not know.
        out = context(query, key, value, scale=scaling, dropout_p=dropout)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _register(name: str, fn) -> None:
    import transformers

    if hasattr(transformers, "AttentionInterface"):
        transformers.AttentionInterface.register(name, fn)
    else:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = fn


def _select(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:
        raise ValueError(
            f"{type(model).__name__} did not take the attention implementation {name!r} (it kept "
            f"{model.config._attn_implementation!r}), so context parallelism cannot replace its attention"
        )


def _pre_forward(context):
    def hook(module, args, kwargs):
        if len(args) > 1:
            raise TypeError(
                "a context-parallel Hugging Face model takes its batch as keyword arguments "
                "(model(**shard_sequence(batch, mesh))), so position_ids and labels cannot be missed"
            )
        tokens = args[0] if args else kwargs.get("input_ids")
        tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
        if tokens is None:
            return None  # the model names the missing input
        local = tokens.shape[1]
        context.check_local_length(local)
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                "a context-parallel model takes no attention_mask (its attention is causal over whole sequences, "
                "whose tokens are spread over the cp ranks): pack documents instead of padding, and pass the batch "
                "through fsdp8.parallel.cp.shard_sequence, which drops an all-ones mask"
            )
        if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            raise ValueError(
                "labels without shift_labels: the model would shift this rank's part of the labels, pairing a "
                "chunk's last token with the wrong next token; cut the batch with fsdp8.parallel.cp.shard_sequence, "
                "which shifts labels before the cut and passes them as shift_labels"
            )
        if kwargs.get("position_ids") is None:
            positions = context.positions(local, tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)
            kwargs = {**kwargs, "position_ids": positions}
        return args, kwargs

    return hook


def context_parallel_hf(model: nn.Module, context) -> nn.Module:
    """Route ``model``'s attention through ``context`` (parallel/cp.py's ContextAttention); see
    fsdp8.parallel.cp.context_parallel."""
    if str(model.config._attn_implementation).startswith("fsdp8_cp_"):
        raise ValueError("the model's attention is already context-parallel (context_parallel applied twice?); "
                         "apply it once")
    _check_attention(model)
    name = f"fsdp8_cp_{next(_names)}"
    _register(name, _hf_attention(context))
    _select(model, name)
    model.register_forward_pre_hook(_pre_forward(context), prepend=True, with_kwargs=True)
    return model
