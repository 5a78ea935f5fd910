"""flash-attn's entry points over torch SDPA (see ../README.md: a benchmark stand-in only)."""

import torch
import torch.nn.functional as F

__version__ = "2.8.3"


def _unsupported(window_size, softcap, alibi_slopes, dropout_p):
    if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or dropout_p:
        raise NotImplementedError("the flash_attn stand-in does sliding windows, softcapping, ALiBi or dropout: none")


def _sdpa(q, k, v, softmax_scale, causal):
    """(batch, seq, heads, dim) in and out, as flash-attn; SDPA works on (batch, heads, seq, dim)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _unsupported(window_size, softcap, alibi_slopes, dropout_p)
    return _sdpa(q, k, v, softmax_scale, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Sequences packed along dim 0 (total tokens, heads, dim), cut by the cumulative lengths
    (read on the host: the packed path synchronises by nature)."""
    _unsupported(window_size, softcap, alibi_slopes, dropout_p)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    pieces = [_sdpa(q[a:b][None], k[c:d][None], v[c:d][None], softmax_scale, causal)[0]
              for a, b, c, d in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:])]
    return torch.cat(pieces)


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the flash_attn stand-in has no KV-cache (paged) attention")
