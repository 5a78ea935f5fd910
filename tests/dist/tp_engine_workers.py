"""Tensor parallelism inside the engine: functions run on every rank by tests/dist/test_tp_engine.py.

The model is a small transformer-shaped stack placed with torch's own ParallelStyles
(colwise up, rowwise down, vocab-sharded embedding and head; sequence parallel norms on
request), so these tests check the engine's side of TP whatever plan placed the weights.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import fsdp8
from fsdp8.fp8.tp import Float8ColwiseParallel
from fsdp8.models.tp_plan import ReplicateParallel

from . import common


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Embedding, blocks, norm, head; the loss on replicated logits."""

    def __init__(self, vocab: int, dim: int = 12, hidden: int = 20, layers: int = 2, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def place(model: Stack, tp_mesh, sequence_parallel: bool = False, tied: bool = False,
          replicated_blocks: bool = False) -> Stack:
    """torch's ParallelStyles: the Megatron layout, sequence-parallel norms on request;
    ``replicated_blocks``: the blocks' linears whole on every rank (ReplicateParallel)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    # Float8ColwiseParallel is ColwiseParallel unless the layer becomes FP8 (fully_shard(fp8=...)).
    block_plan = {
        "up": Float8ColwiseParallel(input_layouts=seq),
        "down": RowwiseParallel(output_layouts=seq),
    }
    if replicated_blocks:
        if sequence_parallel:
            raise ValueError("replicated blocks take the whole sequence: no sequence parallelism")
        block_plan = {"up": ReplicateParallel(), "down": ReplicateParallel(), "norm": ReplicateParallel()}
    if sequence_parallel:
        block_plan["norm"] = SequenceParallel()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    top = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": Float8ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    if tied:
        # Each style distributes its own copy; both shard dim 0 of the same (vocab, dim) weight.
        model.head.weight = model.embed.weight
    return model


def world_mesh(dp_replicate: int, dp_shard: int, tp: int):
    device = common.device().type
    if dp_replicate > 1:
        return init_device_mesh(device, (dp_replicate, dp_shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    return init_device_mesh(device, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))


def dp_of(mesh) -> Tuple[int, int]:
    """(rank, size) of this rank among the data-parallel ranks (ranks of one tp group share a batch)."""
    names = [n for n in mesh.mesh_dim_names if n != "tp"]
    rank, size = 0, 1
    for n in names:
        rank = rank * mesh[n].size() + mesh[n].get_local_rank()
        size *= mesh[n].size()
    return rank, size


def build(vocab: int, seed: int = 0, **kw) -> Stack:
    """Drawn on the device the engine materializes meta models on (the GPU's generator
    differs from the CPU's), so a meta-initialized copy draws the same values."""
    torch.manual_seed(seed)
    with torch.device(common.device()):
        return Stack(vocab, **kw)


def train(model, mesh, steps: int, batch_per_rank: int = 2, seq: int = 8, lr: float = 1e-3, clip: float = 1.0,
          micro_batches: int = 1, vocab: int = 0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    r, w = dp_of(mesh)
    norms = []
    for step in range(steps):
        x, y = common.global_batch(step, batch_per_rank * w * micro_batches, seq, vocab)
        x, y = common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device())
        for mb in range(micro_batches):
            xs, ys = x.chunk(micro_batches)[mb], y.chunk(micro_batches)[mb]
            ctx = model.no_sync() if mb < micro_batches - 1 else _null()
            with ctx:
                (model(xs, ys) / micro_batches).backward()
        if clip:
            norms.append(float(fsdp8.clip_grad_norm_(model, clip)))
        opt.step()
        opt.zero_grad()
    return norms


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def reference_train(model, steps: int, dp_size: int, batch_per_rank: int = 2, seq: int = 8, lr: float = 1e-3,
                    clip: float = 1.0, micro_batches: int = 1, vocab: int = 0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    norms = []
    for step in range(steps):
        x, y = common.global_batch(step, batch_per_rank * dp_size * micro_batches, seq, vocab)
        model(x.to(common.device()), y.to(common.device())).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms


def full_state(model) -> Dict[str, torch.Tensor]:
    # clone: a replicated DTensor's full_tensor() is its local tensor, which training updates in place
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in model.state_dict().items()}


def errors(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Dict[str, float]:
    return {k: float((got[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12)) for k, v in want.items()}


def parity(strategy: str, mesh_shape=(2, 2), outer: str = "no_shard", sequence_parallel: bool = False,
           steps: int = 4, micro_batches: int = 1, tied: bool = False, vocab: Optional[int] = None, meta: bool = False):
    """Train TP x data-parallel and in one process from the same init and global batches."""
    dp_replicate, dp_shard, tp = (1,) + tuple(mesh_shape) if len(mesh_shape) == 2 else tuple(mesh_shape)
    mesh = world_mesh(dp_replicate, dp_shard, tp)
    vocab = vocab or 4 * dist.get_world_size() + 1
    reference = build(vocab, tied=tied)
    if meta:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Stack(vocab, tied=tied)
    else:
        model = copy.deepcopy(reference)
    place(model, mesh["tp"], sequence_parallel, tied)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    if meta:
        torch.manual_seed(0)
    sharded = fsdp8.fully_shard(model, mesh=dp_mesh, strategy=strategy, outer_strategy=outer)
    init_err = errors(full_state(sharded), {k: v.detach().cpu() for k, v in reference.state_dict().items()})
    norms = train(sharded, mesh, steps, micro_batches=micro_batches, vocab=vocab)
    ref_norms = reference_train(reference, steps, dp_of(mesh)[1], micro_batches=micro_batches, vocab=vocab)
    sd = sharded.state_dict()
    placements = {k: [str(p) for p in v.placements] for k, v in sd.items() if isinstance(v, DTensor)}
    tied_ok = (not tied) or sharded.head.weight is sharded.embed.weight
    err = errors(full_state(sharded), {k: v.detach().cpu() for k, v in reference.state_dict().items()})
    return {"errors": err, "init": init_err, "norms": norms, "ref_norms": ref_norms, "placements": placements,
            "tied": tied_ok, "report": sharded.memory_report().persistent}


# -- checkpoints across (dp_replicate, dp_shard, tp) ----------------------------------------------
def _layout_model(mesh_shape, vocab: int, seed: int = 0, strategy: str = "optim_grads_params",
                  sequence_parallel: bool = False, fp8: Optional[str] = None):
    """A Stack placed on (dp_replicate, dp_shard, tp) and sharded; tp 1 means no TP at all.
    With ``fp8`` (a recipe name) its block linears are FP8, at FP8-friendly widths."""
    from fsdp8.fp8.recipes import recipe_from_name

    dp_replicate, dp_shard, tp = mesh_shape
    recipe = recipe_from_name(fp8) if fp8 else None
    model = build(vocab, seed=seed, **({"dim": 32, "hidden": 64} if fp8 else {}))
    if tp == 1:
        mesh = fsdp8.make_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard)
        sharded = fsdp8.fully_shard(model, mesh=mesh, strategy=strategy, fp8=recipe)
        return sharded, mesh
    mesh = fsdp8.make_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    place(model, mesh["tp"], sequence_parallel)
    return fsdp8.fully_shard(model, mesh=mesh, strategy=strategy, fp8=recipe), mesh


def _snapshot(model, opt) -> Dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in full_state(model).items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"optim/{names[id(p)]}/{key}"] = (value.full_tensor() if isinstance(value, DTensor) else value).cpu().clone()
    return out


def checkpoint_hop(path_in: Optional[str], path_out: str, mesh_shape, vocab: int = 18, train_steps: int = 2,
                   first_step: int = 0, fp8: Optional[str] = None):
    """Load ``path_in`` (if given) into a model of layout ``mesh_shape``, snapshot, train, save."""
    # A later hop starts from another init: everything must come from the file.
    model, mesh = _layout_model(tuple(mesh_shape), vocab, seed=1 if path_in is None else 100, fp8=fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loaded = None
    if path_in is not None:
        extra = fsdp8.load(path_in, model, opt)
        first_step = int(extra["step"])
        loaded = _snapshot(model, opt)
    r, w = dp_of(mesh) if "tp" in (mesh.mesh_dim_names or ()) else (dist.get_rank(), dist.get_world_size())
    for step in range(first_step, first_step + train_steps):
        x, y = common.global_batch(step, 4, 8, vocab)
        x, y = common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device())
        model(x, y).backward()
        fsdp8.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    fsdp8.save(path_out, model, opt, extra={"step": first_step + train_steps})
    # After the save: it agrees delayed scaling's pending amaxes over all ranks first.
    return loaded, _snapshot(model, opt)


def checkpoint_reference(steps: int, vocab: int = 18):
    """One process, the same data: what every layout's training must reproduce."""
    model = build(vocab, seed=1)
    reference_train(model, steps, 1, batch_per_rank=4, vocab=vocab)
    return {f"model/{k}": v.detach().cpu() for k, v in model.state_dict().items()}


def load_plain(path: str, vocab: int = 18):
    """A TP checkpoint read into a plain model with torch.distributed.checkpoint alone."""
    import torch.distributed.checkpoint as dcp

    plain = build(vocab, seed=9)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path)
    return {f"model/{k}": v.detach().cpu() for k, v in state["model"].items()}



def _fsdp2_tp(vocab: int, seed: int, mesh_shape):
    """The same Stack under torch FSDP2 + TP (the same styles), sharded over the dp dims."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    dp_replicate, dp_shard, tp = mesh_shape
    mesh = fsdp8.make_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    model = place(build(vocab, seed=seed), mesh["tp"])
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    for block in model.blocks:
        torch_fully_shard(block, mesh=dp_mesh)
    torch_fully_shard(model, mesh=dp_mesh)
    return model, mesh


def fsdp2_tp_interop(path_from_fsdp2: str, path_from_fsdp8: str, vocab: int = 18):
    """torch FSDP2 + TP at (dp 2, tp 2) writes a checkpoint fsdp8 loads at (dp 1, tp 4), and
    fsdp8's checkpoint loads back into FSDP2 + TP; weights and AdamW moments bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    theirs, mesh = _fsdp2_tp(vocab, 1, (1, 2, 2))
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.1)
    r, w = dp_of(mesh)
    for step in range(2):
        x, y = common.global_batch(step, 4, 8, vocab)
        theirs(common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device())).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(theirs), "optim": get_optimizer_state_dict(theirs, opt)},
             checkpoint_id=path_from_fsdp2)
    saved = _snapshot(theirs, opt)

    ours, _ = _layout_model((1, 1, 4), vocab, seed=100)
    our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, weight_decay=0.1)
    fsdp8.load(path_from_fsdp2, ours, our_opt)
    into_fsdp8 = _snapshot(ours, our_opt)
    fsdp8.save(path_from_fsdp8, ours, our_opt)

    back, _ = _fsdp2_tp(vocab, 7, (1, 2, 2))
    back_opt = torch.optim.AdamW(back.parameters(), lr=1e-3, weight_decay=0.1)
    back(*(t.to(common.device()) for t in common.global_batch(0, 1, 8, vocab))).backward()  # creates AdamW state
    back_opt.step()
    back_opt.zero_grad()
    state = {"model": get_model_state_dict(back), "optim": get_optimizer_state_dict(back, back_opt)}
    dcp.load(state, checkpoint_id=path_from_fsdp8)
    set_model_state_dict(back, state["model"])
    set_optimizer_state_dict(back, back_opt, state["optim"])
    into_fsdp2 = _snapshot(back, back_opt)
    return saved, into_fsdp8, into_fsdp2


# -- memory and bad input --------------------------------------------------------------------------
def memory_per_rank(vocab: int = 20):
    """memory_report() at dp 2 x tp 2 against the unsharded model's sizes: tp-sharded weights
    are split four ways, tp-replicated ones (norms, rowwise biases) two ways."""
    mesh = fsdp8.make_mesh(dp_shard=2, tp=2)
    model = place(build(vocab), mesh["tp"])
    split = {n: not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements)
             for n, p in model.named_parameters()}
    numel = {n: p.numel() for n, p in model.named_parameters()}
    sharded = fsdp8.fully_shard(model, mesh=mesh)
    expected = sum(numel[n] // (2 if replicated else 4) for n, replicated in split.items()) * 4
    return sharded.memory_report().main_weights, expected


def bad_tp_inputs():
    """Mistakes in combining TP with fully_shard; each must raise on every rank before a hang."""
    messages = []
    mesh = fsdp8.make_mesh(dp_shard=2, tp=2)

    def attempt(fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            messages.append(str(e))
        else:
            messages.append(None)

    # A data-parallel mesh that, with tp, does not cover the world.
    world_dp = fsdp8.make_mesh()
    attempt(lambda: fsdp8.fully_shard(place(build(18), mesh["tp"]), mesh=world_dp))
    # A world mesh with tp > 1 but a model nobody placed.
    attempt(lambda: fsdp8.fully_shard(build(18), mesh=mesh))
    # Parameters on two different tp meshes.
    other = init_device_mesh(common.device().type, (2, 2), mesh_dim_names=("dp_x", "tp_x"))

    def two_meshes():
        model = build(18)
        parallelize_module(model.blocks[0], mesh["tp"], {"up": ColwiseParallel()})
        parallelize_module(model.blocks[1], other["tp_x"], {"up": ColwiseParallel()})
        fsdp8.fully_shard(model, mesh=mesh)

    attempt(two_meshes)
    return messages
