"""Context parallelism: each rank of the cp group attends with its slice of every sequence.

[Note: head-tail chunks]
A sequence of length S is cut into 2 x cp chunks of L = S / (2 cp) tokens; cp rank r holds
chunks r and 2cp-1-r, concatenated (``rank_positions``). Under causal attention a query of
chunk c looks at (c + 1) L keys, so rank r's two chunks look at (r + 1) L + (2cp - r) L =
(2cp + 1) L keys whatever r is: every rank does the same work (the Llama 3 / Megatron
layout), where contiguous slices would leave rank 0 with 1/cp^2 of the last rank's.

[Note: the attention]
Keys and values are all-gathered over the cp group (the Llama 3 scheme: with GQA they are
n_kv_heads / n_heads of the queries' size, and they are gathered before their heads are
repeated); the backward reduce-scatters (sums) their gradients back to their owners. The
gathered chunks are put in global order and each of the rank's two query chunks attends
to the keys up to its own end with a bottom-right-aligned causal mask
(``torch.nn.attention.bias.causal_lower_right``): the chunk's last query sees every key,
its first query the keys up to its own position. That bias reaches SDPA's flash or
memory-efficient kernel on CUDA without a dense mask, and the math kernel on CPU.

[Note: the loss over cp ranks]
The engine averages gradients over every data-parallel and cp rank (W of them; tp ranks
hold the same tokens). For the result to be the gradient of the mean over all N valid
tokens of the global batch, whatever the layout, each rank's loss must be the sum of its
own tokens' losses divided by N / W (``loss_divisor``); a per-rank mean would weigh a
rank's tokens by 1 / its own count, which differs between ranks as soon as labels are
ignored (-100: padding, or the last position after the shift).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right
from torch.profiler import record_function

from ..distributed.comm import all_gather_single_fn, reduce_scatter_single_fn
from ..distributed.process_group import mesh_device
from ..models.adapter import adapter_for

IGNORE_INDEX = -100  # the label value cross-entropy skips (torch's and Hugging Face's default)


# -- pure layout math ---------------------------------------------------------------------------
def rank_chunks(rank: int, cp: int) -> Tuple[int, int]:
    """The two global chunk indices cp rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def chunk_sources(cp: int) -> list:
    """For each global chunk, in order: ``(rank, j)``, the rank holding it and whether it is
    that rank's first (0) or second (1) chunk: where it sits in a rank-major all-gather."""
    return [(c, 0) if c < cp else (2 * cp - 1 - c, 1) for c in range(2 * cp)]


def local_multiple(cp: int, tp: int = 1) -> int:
    """What each rank's part of a sequence must be a multiple of: 2 (its two chunks), and tp
    under sequence parallelism (which splits that part over the tp ranks)."""
    return 2 * tp // math.gcd(2, tp)


def check_sequence_length(seq_len: int, cp: int, tp: int = 1) -> None:
    """Raise ValueError unless a global sequence of ``seq_len`` tokens cuts evenly over cp
    (and over tp, given tp > 1 when sequence parallelism splits each rank's part)."""
    multiple = cp * local_multiple(cp, tp)
    if seq_len % multiple:
        split = f"2 x cp = {2 * cp} equal chunks (two per rank, so causal work is balanced)"
        if tp > 1:
            split += f", and sequence parallelism splits each rank's part over tp={tp}"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {multiple}: context parallelism over cp={cp} ranks "
            f"cuts every sequence into {split}; pad or cut sequences to a multiple of {multiple}"
        )


def rank_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The global positions [seq_len / cp] of the tokens cp rank ``rank`` holds of a sequence
    of ``seq_len`` tokens, in the order it holds them."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in rank_chunks(rank, cp)])


def shard_tensor(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along its sequence dim ``dim``: chunks r and 2cp-1-r of 2cp."""
    chunk = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in rank_chunks(rank, cp)], dim=dim)


def unshard_tensor(parts, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` from rank r): inverse of shard_tensor."""
    cp = len(parts)
    chunk = parts[0].shape[dim] // 2
    return torch.cat([parts[r].narrow(dim, j * chunk, chunk) for r, j in chunk_sources(cp)], dim=dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Hugging Face's label shift: position i learns token i + 1; the last position learns nothing."""
    return torch.cat([labels[..., 1:], labels.new_full(labels.shape[:-1] + (1,), ignore_index)], dim=-1)


# -- meshes ---------------------------------------------------------------------------------------
def _cp_and_tp(mesh: DeviceMesh, sequence_parallel: bool) -> Tuple[DeviceMesh, int]:
    """The 1-D cp mesh of ``mesh`` (the world mesh or its cp dim) and the tp size that splits
    each rank's sequence part (1 without sequence parallelism)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh from fsdp8.make_mesh(cp=N, ...), got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" in names:
        cp_mesh = mesh if mesh.ndim == 1 else mesh["cp"]
    elif mesh.ndim == 1 and not names:
        cp_mesh = mesh
    else:
        raise ValueError(
            f"mesh with dimensions {names or tuple(mesh.shape)} has no 'cp' dimension; build the world mesh "
            "with fsdp8.make_mesh(cp=N, ...) and pass it, or its mesh['cp']"
        )
    world = tuple(mesh._get_root_mesh().mesh_dim_names or ())
    if sequence_parallel and "tp" not in world:
        raise ValueError("sequence_parallel=True, but the mesh has no tp dimension: pass the world mesh from "
                         "fsdp8.make_mesh(cp=, tp=)")
    return cp_mesh, mesh._get_root_mesh()["tp"].size() if sequence_parallel else 1


# -- batches --------------------------------------------------------------------------------------
# Keys shard_sequence knows: Hugging Face's (labels shifted before the cut) and the built-in Llama's.
_SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "tokens", "targets")


def shard_sequence(batch: Dict[str, torch.Tensor], mesh: DeviceMesh, sequence_parallel: bool = False,
                   ignore_index: int = IGNORE_INDEX) -> Dict[str, torch.Tensor]:
    """This cp rank's part of a batch of whole sequences ``[batch, seq]``: pure cutting, the same
    on every rank of a cp group (which must all be given the same batch).

    Hugging Face keys: ``input_ids``; ``labels`` (unshifted, as HF models take them) are
    shifted first, so the label of a chunk's last token comes from the next chunk, and come
    back as ``labels`` and ``shift_labels`` (transformers' causal-LM loss uses
    ``shift_labels`` as they are and only needs ``labels`` to be there); ``position_ids``
    (created when absent) are the tokens' global positions. ``attention_mask`` may only be
    all ones (pack sequences rather than pad them) and is dropped. The built-in Llama's keys:
    ``tokens`` and ``targets`` (already next-token targets, cut as they are); its positions
    come from the model. ``mesh``: the world mesh from ``fsdp8.make_mesh(cp=...)``; with
    ``sequence_parallel`` the tp size must divide each rank's part too. Raises ValueError on
    every rank, before anything is communicated, for an uneven length or an unknown key."""
    unknown = [key for key in batch if key not in _SEQUENCE_KEYS]
    if unknown:
        raise ValueError(
            f"shard_sequence does not know how to cut {unknown}; it cuts {', '.join(_SEQUENCE_KEYS)} "
            "(cut other [batch, seq] tensors with fsdp8.parallel.cp.shard_tensor)"
        )
    cp_mesh, tp = _cp_and_tp(mesh, sequence_parallel)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    tokens = batch.get("input_ids", batch.get("tokens"))
    if tokens is None or tokens.dim() != 2:
        raise ValueError("shard_sequence needs input_ids (Hugging Face) or tokens (fsdp8's Llama) of shape [batch, seq]")
    seq_len = tokens.shape[1]
    check_sequence_length(seq_len, cp, tp)
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "attention_mask has padding (zeros): context-parallel attention is causal over whole sequences and "
            "takes no mask; pack documents into full sequences instead of padding them"
        )
    out = {}
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        if value.shape[-1] != seq_len:
            raise ValueError(f"{key} has shape {tuple(value.shape)}, but the sequences have {seq_len} tokens")
        if key == "labels":
            value = shift_labels(value, ignore_index)
            out["shift_labels"] = shard_tensor(value, rank, cp, dim=-1)
        out[key] = shard_tensor(value, rank, cp, dim=-1)
    if "input_ids" in batch and "position_ids" not in batch:
        out["position_ids"] = rank_positions(seq_len, rank, cp, tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)
    return out


def loss_divisor(labels: torch.Tensor, mesh: DeviceMesh, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """What this rank's summed token loss is divided by: N / W, N the valid labels of the whole
    global batch and W the data-parallel x cp ranks (see [Note: the loss over cp ranks]).

    ``labels``: the labels this rank computes its loss on (after shard_sequence: its part,
    shifted), on the mesh's device; ``mesh``: any mesh of fsdp8.make_mesh (its world mesh is
    what counts). Pass the result as ``num_items_in_batch=`` to a Hugging Face causal LM or
    the built-in Llama; averaging the ranks' losses, which the engine's gradient reduction
    does, then gives the mean over every token of the global batch. One all-reduce of one
    number per data-parallel and cp mesh dimension."""
    world = mesh._get_root_mesh()
    names = tuple(world.mesh_dim_names or ())
    dims = [world[name] for name in ("dp_replicate", "dp_shard", "cp") if name in names] or [world]
    # On the mesh's device: NCCL reduces device tensors only, and labels may still be on the host.
    count = (labels != ignore_index).sum().to(mesh_device(world))
    for sub in dims:
        with record_function("fsdp8::all_reduce[cp loss token count]"):
            dist.all_reduce(count, group=sub.get_group())
    return count.to(torch.float32) / math.prod(sub.size() for sub in dims)


# -- the attention --------------------------------------------------------------------------------
class _GatherSequence(torch.autograd.Function):
    """All-gather over the cp group (rank-major, a new leading dim); the backward sums each
    rank's gradient of the gathered tensor and returns every rank its own piece's sum."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group = group
        out = local.new_empty((size,) + tuple(local.shape))
        with record_function("fsdp8::all_gather[cp keys and values]"):
            all_gather_single_fn()(out.view(-1), local.contiguous().view(-1), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        with record_function("fsdp8::reduce_scatter[cp key and value gradients]"):
            reduce_scatter_single_fn()(out.view(-1), grad.contiguous().view(-1), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


@torch.compiler.disable
def _gather(local: torch.Tensor, group, size: int) -> torch.Tensor:
    # Kept out of torch.compile's graphs: a compiled block breaks its graph here and runs the
    # c10d collective and its backward eagerly; the attention around it still compiles
    # (checked: a compiled cp Llama block equals the eager one to fp32 rounding).
    return _GatherSequence.apply(local, group, size)


def attend_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, cp: int,
                  scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of rank ``rank``'s queries ``q`` [b, heads, 2L, d] (its two chunks) over
    keys and values ``k``, ``v`` [b, kv_heads, >= (2cp - rank) L, d] in global order (the
    gathered sequence up to at least the end of the rank's second chunk). No communication:
    see [Note: the attention]."""
    chunk = q.shape[-2] // 2
    group = q.shape[1] // k.shape[1]
    last = (max(rank_chunks(rank, cp)) + 1) * chunk
    k, v = k[:, :, :last], v[:, :, :last]
    if group > 1:
        # After the gather and the cut: the repeated heads are never communicated.
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = []
    for i, c in enumerate(rank_chunks(rank, cp)):
        keys = (c + 1) * chunk
        out.append(F.scaled_dot_product_attention(
            q[:, :, i * chunk:(i + 1) * chunk], k[:, :, :keys], v[:, :, :keys],
            attn_mask=causal_lower_right(chunk, keys), dropout_p=dropout_p, scale=scale))
    return torch.cat(out, dim=2)


def _global_order(gathered: torch.Tensor, shape: torch.Size, rank: int, cp: int) -> torch.Tensor:
    """From rank-major gathered parts [cp, *shape] (shape [b, heads, 2L, d]) to the global
    sequence [b, heads, (2cp - rank) L, d]: the chunks rank ``rank``'s queries can see."""
    parts = gathered.view((cp,) + tuple(shape)).unflatten(3, (2, shape[2] // 2))
    needed = chunk_sources(cp)[: max(rank_chunks(rank, cp)) + 1]
    return torch.cat([parts[src, :, :, j] for src, j in needed], dim=2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, rank: int, cp: int,
              scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Context-parallel causal attention: ``q`` [b, heads, 2L, d], ``k``, ``v`` [b, kv_heads, 2L, d]
    of this rank's two chunks (rotary already applied at their global positions); returns
    [b, heads, 2L, d]. Keys and values travel in one all-gather over ``group`` (a cp
    ProcessGroup of ``cp`` ranks, this one ``rank`` in it), their gradients in one
    reduce-scatter."""
    if q.shape[-2] % 2:
        raise ValueError(f"this rank holds {q.shape[-2]} tokens per sequence; context parallelism needs an even "
                         "number (two chunks): cut sequences with fsdp8.parallel.cp.shard_sequence")
    gathered = _gather(torch.cat((k.reshape(-1), v.reshape(-1))), group, cp)
    k_all = _global_order(gathered[:, : k.numel()], k.shape, rank, cp)
    v_all = _global_order(gathered[:, k.numel():], v.shape, rank, cp)
    return attend_chunks(q, k_all, v_all, rank, cp, scale, dropout_p)


class ContextAttention:
    """Context-parallel attention over the cp dim of ``mesh``: ``(q, k, v, scale=None,
    dropout_p=0.0) -> out`` as ``attention``, with the checks a model's pre-forward hook runs.

    What context_parallel hands the model's adapter to put into the model (the adapter's
    ``CPAttention``); a model of one's own calls it from its attention."""

    def __init__(self, mesh: DeviceMesh, sequence_parallel: bool = False):
        cp_mesh, self.tp = _cp_and_tp(mesh, sequence_parallel)
        self.group, self.cp, self.rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()

    def __call__(self, q, k, v, scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
        return attention(q, k, v, self.group, self.rank, self.cp, scale, dropout_p)

    def __deepcopy__(self, memo):
        return self  # a process group is shared, not copied (copy.deepcopy of a context-parallel model)

    def check_local_length(self, local_len: int) -> None:
        """Raise, before anything is communicated, unless this rank's ``local_len`` tokens per
        sequence are a valid part (the same check on every rank of the group)."""
        if local_len % local_multiple(self.cp, self.tp):
            try:
                check_sequence_length(local_len * self.cp, self.cp, self.tp)
            except ValueError as e:
                raise ValueError(f"this rank holds {local_len} tokens of each sequence: {e}") from None

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens of each sequence."""
        return rank_positions(local_len * self.cp, self.rank, self.cp, device)


def context_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Make ``model``'s attention context-parallel over the cp dim of ``mesh``; returns ``model``.

    ``mesh``: the world mesh from ``fsdp8.make_mesh(cp=N, ...)`` (or its 1-D ``mesh['cp']``);
    ``sequence_parallel``: whether tensor parallelism also splits the sequence (so tp must
    divide each rank's part). After this the model takes this rank's part of each sequence
    (``shard_sequence``). How the attention is reached is the model's adapter's
    (fsdp8.models.adapter_for): the built-in Llama's attention is swapped and it computes its
    tokens' global positions itself; a Hugging Face causal LM takes them as ``position_ids``
    (filled in when absent) and its attention goes through transformers' attention-function
    registry. Apply it before or after ``tensor_parallel`` and before ``fully_shard``. Raises
    on every rank, before anything is communicated, for a model whose attention it cannot
    reach (a model of one's own calls a ``ContextAttention`` from its attention)."""
    return adapter_for(model).context_parallel(model, ContextAttention(mesh, sequence_parallel))
