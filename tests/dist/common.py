"""Models, data and reference trainers shared by the distributed tests (run inside workers)."""

from __future__ import annotations

import contextlib
import copy
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import fsdp8

VOCAB_EXTRA = 1  # vocab = 4 * world + 1: rows never divide evenly


class UnevenBlock(nn.Module):
    """Odd widths (17) and a projection narrower (3) than the largest world size (4)."""

    def __init__(self, dim: int = 17, narrow: int = 3):
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.narrow = nn.Linear(dim, narrow)
        self.back = nn.Linear(narrow, dim, bias=False)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x + self.back(torch.tanh(self.narrow(torch.relu(self.up(x))))) * self.scale


class UnevenModel(nn.Module):
    def __init__(self, vocab: int, dim: int = 17, layers: int = 2, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([UnevenBlock(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens, targets=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# FP8 parity runs compute in fp64 on every backend: the FP8 GEMMs then take the exact
# emulation (fp64 products of FP8 values; cuBLAS's FP8 GEMMs write no fp64), and what can differ
# between a parallel run and one process is the fp64 order of the sums around them. In fp32 an
# ulp of such a difference crosses an FP8 rounding boundary about once in 2^20 values, and the
# flipped byte (2^-3 relative) reaches every later layer: a norm bias's cancelling gradient sum
# showed 4.7e-5 on a CPU, and on GPUs, whose forward FP8 GEMM accumulates with ~14 bits, byte
# flips moved gradients by percents. In fp64 that chance is about 2^-49 per value. The native
# GEMMs' own accuracy is tested against the emulation in tests/gpu/test_fp8_gpu.py.
FP8_PARITY_PRECISION = fsdp8.Precision(param_dtype=torch.float64, reduce_dtype=torch.float64)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value; one whose shard lives in host memory (offload) on a GPU mesh is
    gathered from the device, where NCCL can move it."""
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:
        t = DTensor.from_local(local.to(device()), t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()


def device() -> torch.device:
    """Where the engine and the reference run: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank()


def mesh(shape):
    """The data-parallel mesh of ``shape``: None (fully_shard's default), ``(S,)`` or, for
    HSDP, ``(R, S)`` (R replicas of S-rank shard groups)."""
    if shape is None:
        return None
    if len(shape) == 2:
        return fsdp8.make_mesh(dp_replicate=shape[0], dp_shard=shape[1])
    return fsdp8.make_mesh(dp_shard=shape[0])


def build(kind: str, seed: int = 0, vocab: Optional[int] = None, **kw) -> nn.Module:
    """A test model on ``device()``, identical on every rank (vocab 4W+1 unless given)."""
    torch.manual_seed(seed)
    return _build(kind, vocab or 4 * max(world(), 1) + VOCAB_EXTRA, **kw).to(device())


def _build(kind: str, vocab: int, **kw) -> nn.Module:
    if kind == "uneven":
        return UnevenModel(vocab, **kw)
    if kind == "llama":
        from fsdp8.models.llama import Llama, LlamaConfig

        cfg = LlamaConfig(
            vocab_size=vocab, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, max_seq_len=16, **kw
        )
        return Llama(cfg)
    raise ValueError(kind)


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 1234) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids (CPU) of a step's global batch, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def rank_slice(t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    b = t.shape[0] // w
    return t[r * b : (r + 1) * b]


def vocab_of(model: nn.Module) -> int:
    embed = getattr(model, "embed", None)
    return embed.num_embeddings if embed is not None else 4 * world() + VOCAB_EXTRA


def train_sharded(model, steps: int, batch_per_rank: int = 2, seq: int = 8, lr: float = 1e-3, clip: float = 1.0,
                  micro_batches: int = 1, opt=None, first_step: int = 0) -> List[float]:
    """``steps`` steps from global batch ``first_step`` on (``opt``: go on with this optimizer)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    w, r = world(), rank()
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step, batch_per_rank * w * micro_batches, seq, vocab_of(model))
        x, y = rank_slice(x, r, w).to(device()), rank_slice(y, r, w).to(device())
        total = 0.0
        for mb in range(micro_batches):
            xs, ys = x.chunk(micro_batches)[mb], y.chunk(micro_batches)[mb]
            last = mb == micro_batches - 1
            ctx = model.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                loss = model(xs, ys) / micro_batches
                loss.backward()
            total += float(loss.detach())
        if clip:
            fsdp8.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def train_reference(model, steps: int, batch_per_rank: int = 2, seq: int = 8, lr: float = 1e-3, clip: float = 1.0,
                    ranks: Optional[int] = None, compute_dtype: Optional[torch.dtype] = None, micro_batches: int = 1,
                    opt=None, first_step: int = 0) -> nn.Module:
    """Single-process training on the global batch.

    fp32: one forward over the whole global batch. With ``compute_dtype`` it mirrors the
    data-parallel recipe exactly (fp32 masters, a compute copy per step, one forward per
    rank slice, fp32 average of the per-rank gradients) so differences are only the
    order of the fp32 gradient sum."""
    w = ranks or world()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step, batch_per_rank * w * micro_batches, seq, vocab_of(model))
        x, y = x.to(device()), y.to(device())
        if compute_dtype is None:
            model(x, y).backward()
        else:
            compute = copy.deepcopy(model).to(compute_dtype)
            for r in range(w):
                xr, yr = rank_slice(x, r, w), rank_slice(y, r, w)
                for mb in range(micro_batches):
                    # Each micro-batch's gradient leaves the compute dtype at once, as in the engine.
                    (compute(xr.chunk(micro_batches)[mb], yr.chunk(micro_batches)[mb]) / micro_batches).backward()
                    for p, c in zip(model.parameters(), compute.parameters()):
                        if c.grad is None:
                            continue
                        g = c.grad.float() / w
                        p.grad = g if p.grad is None else p.grad + g
                        c.grad = None
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model


def lockstep_errors(sharded, reference: nn.Module, steps: int, compute_dtype: torch.dtype,
                    micro_batches: int = 1, lr: float = 1e-3) -> Dict[str, float]:
    """Worst relative error per parameter over ``steps`` steps of both trainings, the
    reference's weights set to the engine's before each step (optimizer states are not).

    Why reset: the two gradient sums differ in fp32 order (~3e-8), and once that moves a
    weight across an FP8 rounding boundary, one byte differs by a whole FP8 step (2^-3
    relative for e4m3) and the runs drift apart chaotically (1e-4 after 4 steps, seen at
    world size 4). With equal weights before every step, the FP8 bytes, scales and GEMMs
    of each step are identical, so each step's error stays at the fp32 summation level
    while every step, and the optimizer and scaling state carried between steps, is still
    checked."""
    opt_sharded = torch.optim.AdamW(sharded.parameters(), lr=lr, weight_decay=0.1)
    opt_reference = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.1)
    worst: Dict[str, float] = {}
    for step in range(steps):
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param.copy_(full[name].to(param.device))
        train_sharded(sharded, 1, micro_batches=micro_batches, opt=opt_sharded, first_step=step)
        train_reference(reference, 1, compute_dtype=compute_dtype, micro_batches=micro_batches, opt=opt_reference,
                        first_step=step)
        for name, err in relative_errors(sharded, reference).items():
            worst[name] = max(worst.get(name, 0.0), err)
    return worst


def relative_errors(sharded, reference: nn.Module) -> Dict[str, float]:
    """``|a - b| / |b|`` per parameter (Frobenius norms), from the sharded state dict."""
    sd = sharded.state_dict()
    out = {}
    for name, ref in reference.state_dict().items():
        if name not in sd:
            continue
        got = sd[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        ref = ref.full_tensor() if hasattr(ref, "full_tensor") else ref
        out[name] = float((got.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm().clamp_min(1e-12))
    return out


def build_fp8_llama(seed: int = 0, **kw) -> nn.Module:
    """A tiny Llama whose block linears are all FP8-friendly (dimensions multiples of 16)."""
    from fsdp8.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=4 * world() + VOCAB_EXTRA, dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                      ffn_dim=64, max_seq_len=16, **kw)
    return Llama(cfg).to(device())


class CountGathers:
    """The engine's all-gathers while active: how many by unit (comm.all_gather's label), the
    bytes every rank receives (the payload) and those bytes by unit (``bytes_by_label``)."""

    def __enter__(self):
        from fsdp8.distributed import comm

        self.counts, self.bytes, self.bytes_by_label = {}, 0, {}
        self._original = comm.all_gather

        def counted(out, inp, group, label):
            self.counts[label] = self.counts.get(label, 0) + 1
            self.bytes += out.numel() * out.element_size()
            self.bytes_by_label[label] = self.bytes_by_label.get(label, 0) + out.numel() * out.element_size()
            return self._original(out, inp, group, label)

        comm.all_gather = counted
        return self

    def __exit__(self, *exc):
        from fsdp8.distributed import comm

        comm.all_gather = self._original
        return False

