"""Tensor-parallel functions run on every rank by tests/dist/test_tp.py (module-level so workers import them).

Every TP group of the world runs the same global batch (data-parallel replicas see identical
data, so no gradient reduction across them is needed) and is compared with the same model
trained in one process.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

from fsdp8.distributed.mesh import make_mesh, tp_mesh
from fsdp8.parallel.tp import tensor_parallel

from . import common


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _full(a).detach().float(), _full(b).detach().float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _tp_mesh(tp: int):
    return tp_mesh(make_mesh(dp_shard=common.world() // tp, tp=tp))


def llama(dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A tiny built-in Llama (4 heads, 2 kv heads) with ``overrides`` of its config."""
    from fsdp8.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    return Llama(LlamaConfig(**{**fields, **overrides})).to(common.device(), dtype)


def hf(family: str = "llama", vocab: int = 128, tie: bool = False, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_class(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                          tie_word_embeddings=tie, attn_implementation="sdpa")
    torch.manual_seed(0)
    return model_class(config).to(common.device(), torch.float32)


def _llama_loss(model, x, y):
    return model(x, y)


def _hf_loss(model, x, y):
    # labels are the inputs: HF shifts them itself.
    return model(input_ids=x, labels=x).loss


def compare_training(model: nn.Module, loss_fn: Callable, tp: int, steps: int = 3, lp: bool = False,
                     lr: float = 0.5, foreach: bool = True, **tp_kw) -> Dict[str, float]:
    """Worst relative error of the TP run against one process: loss, every gradient and every
    weight after each of ``steps`` SGD steps (keys ``loss``, ``grad:<name>``, ``weight:<name>``;
    a tied parameter split in two shows as ``tied parameters split``), and the sequence
    lengths the first decoder layer's input had on this rank.

    Each step starts the reference from the TP run's weights, so that a step's errors are that
    step's rounding alone: carried over at lr 0.5, the previous steps' rounding grows into the
    next gradients by a factor that depends on the CPU's summation order (3.6e-6 after three
    steps on one AVX2 machine, where one step is 4e-7). Every step's update is still checked.

    SGD, not AdamW: Adam's update of an element whose gradient is ~0 is +-lr whatever
    its size, so fp32 rounding differences (~3e-7 relative, the floor of a reordered
    fp32 sum here) would flip such elements by a whole lr and the runs would drift."""
    reference = copy.deepcopy(model)
    tensor_parallel(model, _tp_mesh(tp), loss_parallel=lp, **tp_kw)
    layers = model.model.layers if hasattr(model, "model") else model.layers
    seen = []
    layers[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(_local_seq(args, kwargs)),
                                        with_kwargs=True)
    # foreach, as torch's optimizers pick on GPUs: it needs every parameter to be a DTensor
    # (a plain tensor among DTensors is refused), which tensor_parallel's own plans give.
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=foreach)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr, foreach=foreach)
    vocab = reference.config.vocab_size  # the built-in Llama's and HF configs name it alike
    worst: Dict[str, float] = {}

    def note(key, err):
        worst[key] = max(worst.get(key, 0.0), err)

    params = dict(model.named_parameters())
    for step in range(steps):
        with torch.no_grad():
            for name, ref in reference.named_parameters():
                ref.copy_(_full(params[name]))
        x, y = (t.to(common.device()) for t in common.global_batch(step, 4, 8, vocab))
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = loss_fn(model, x, y)
            loss.backward()
        ref_loss = loss_fn(reference, x, y)
        ref_loss.backward()
        note("loss", _rel(loss, ref_loss))
        for name, ref in reference.named_parameters():
            note(f"grad:{name}", _rel(params[name].grad, ref.grad))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        for name, ref in reference.named_parameters():
            note(f"weight:{name}", _rel(params[name], ref))
    if len(params) != len(dict(reference.named_parameters())):
        worst["tied parameters split"] = float("inf")
    return worst, sorted(set(seen))


def _local_seq(args, kwargs) -> int:
    """The sequence length this rank holds of a decoder layer's input (its hidden states)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    return (hidden.to_local() if isinstance(hidden, DTensor) else hidden).shape[1]


def llama_parity(tp: int, sequence_parallel: bool = False, lp: bool = False, model_kw: Optional[dict] = None):
    return compare_training(llama(**(model_kw or {})), _llama_loss, tp, sequence_parallel=sequence_parallel, lp=lp)


def hf_parity(tp: int, family: str = "llama", sequence_parallel: bool = False, lp: bool = False,
              model_kw: Optional[dict] = None):
    return compare_training(hf(family, **(model_kw or {})), _hf_loss, tp, sequence_parallel=sequence_parallel, lp=lp)



def _hf_packed() -> nn.Module:
    model = hf()
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan,
                                       "layers.*.self_attn.q_proj": "packed_colwise"}
    return model


# name -> (model builder, tensor_parallel keyword arguments)
BAD_INPUTS = {
    "kv_heads": (lambda: llama(n_kv_heads=1), {}),
    "heads": (lambda: llama(dim=36, n_heads=3, n_kv_heads=3), {}),
    "ffn": (lambda: llama(ffn_dim=49), {}),
    "unknown_key": (llama, {"plan": {"layers.*.attn.wz": ColwiseParallel()}}),
    "not_a_style": (llama, {"plan": {"head": "colwise"}}),
    "no_plan": (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), {}),
    "uneven_features": (lambda: nn.Sequential(nn.Linear(8, 15)), {"plan": {"0": ColwiseParallel()}}),
    "tied_split": (lambda: llama(tie_embeddings=True), {"plan": {"head": None}}),
    "hf_kv_heads": (lambda: hf(kv_heads=1), {}),
    "hf_unsupported": (_hf_packed, {}),
    "two_d_mesh": (llama, {}),
    "twice": (lambda: tensor_parallel(llama(), _tp_mesh(common.world())), {}),
}


def bad_input(name: str):
    """tensor_parallel on a bad input: (the error message or None, whether the call replaced
    any parameter, i.e. distributed something before its error)."""
    build, kwargs = BAD_INPUTS[name]
    model = build()
    world = common.world()
    mesh = make_mesh(dp_shard=1, tp=world)
    mesh = mesh if name == "two_d_mesh" else tp_mesh(mesh)
    before = [id(p) for p in model.parameters()]
    try:
        tensor_parallel(model, mesh, **kwargs)
        message = None
    except (ValueError, TypeError) as e:
        message = str(e)
    return message, [id(p) for p in model.parameters()] != before


def plan_overrides():
    """User plans: ``None`` keeps the matched modules whole (the built-in Llama's feed-forward
    here); a custom model's plan alone. Returns, for each, the worst relative error against
    one process and the names of the parameters left plain tensors."""
    tp = common.world()
    model = llama()
    # The caller's None leaves the feed-forward's parameters plain beside DTensors: a mix
    # foreach optimizers refuse, which tensor_parallel warns of.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors, _ = compare_training(model, _llama_loss, tp, plan={"layers.*.ffn.*": None}, foreach=False)
    if not any("left 6 parameters as plain tensors" in str(w.message) for w in caught):
        errors["no warning about plain parameters"] = float("inf")
    llama_plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4)).to(common.device())
    reference = copy.deepcopy(mlp)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(common.device())
    tensor_parallel(mlp, _tp_mesh(tp), plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    mlp(x).square().sum().backward()
    reference(x).square().sum().backward()
    mlp_errors = [_rel(p.grad, ref.grad) for p, ref in zip(mlp.parameters(), reference.parameters())]
    mlp_plain = [name for name, p in mlp.named_parameters() if not isinstance(p, DTensor)]
    return max(errors.values()), llama_plain, max(mlp_errors), mlp_plain


def sequence_not_divisible():
    """The error a sequence-parallel forward gives for a sequence length tp does not divide."""
    model = tensor_parallel(llama(), _tp_mesh(common.world()), sequence_parallel=True)
    x, y = (t.to(common.device()) for t in common.global_batch(0, 2, 2 * common.world() + 1, 64))
    try:
        model(x, y)
    except ValueError as e:
        return str(e)
    return None


def meta_model():
    """tensor_parallel on a Llama built on the meta device: (head weight placements, the
    local shard's shape, whether the tie survived, whether anything was allocated)."""
    from fsdp8.models.llama import Llama

    config = llama(vocab_size=63, tie_embeddings=True).config
    with torch.device("meta"):
        model = Llama(config)
    tensor_parallel(model, _tp_mesh(common.world()), sequence_parallel=True, loss_parallel=True)
    head = model.head.weight
    allocated = any(not (p.to_local() if isinstance(p, DTensor) else p).is_meta for p in model.parameters())
    return tuple(map(repr, head.placements)), tuple(head.to_local().shape), head is model.embed.weight, allocated


MESH_CASES = [
    {},
    {"dp_replicate": 2},
    {"tp": 2},
    {"dp_replicate": 2, "tp": 2},
    {"cp": 2, "tp": 2},
    {"dp_replicate": 2, "cp": 2},
    {"dp_shard": 1, "tp": -1},
]


def mesh_layouts():
    """For each of MESH_CASES: the world mesh's names and shape, the data-parallel mesh's names
    and ranks, the tp mesh's ranks, and the sizes the dp and tp groups report by all-reduce."""
    import torch.distributed as dist

    from fsdp8.distributed.mesh import data_parallel_mesh

    out = []
    for kwargs in MESH_CASES:
        mesh = make_mesh(**kwargs)
        dp, tp = data_parallel_mesh(mesh), tp_mesh(mesh)
        one = torch.ones((), device=common.device())
        group = dp.get_group(dp.ndim - 1)
        dist.all_reduce(one, group=group)
        out.append((mesh.mesh_dim_names, tuple(mesh.shape), dp.mesh_dim_names, dp.mesh.tolist(),
                    None if tp is None else tp.mesh.tolist(), int(one)))
    return out


def loss_outside_loss_parallel():
    """The built-in Llama's error for vocabulary-sharded logits without loss_parallel()."""
    model = tensor_parallel(llama(), _tp_mesh(common.world()), loss_parallel=True)
    x, y = (t.to(common.device()) for t in common.global_batch(0, 2, 8, 64))
    try:
        model(x, y)
    except RuntimeError as e:
        return str(e)
    return None


def mesh_reuse():
    """Process groups the first and the second make_mesh / make_expert_mesh of one layout create,
    whether the second returned the first's meshes, and whether another layout got its own."""
    from torch.distributed import distributed_c10d

    from fsdp8.distributed.mesh import make_expert_mesh

    def groups():
        return len(distributed_c10d._world.pg_map)

    before = groups()
    first = make_mesh(dp_replicate=2, tp=2)
    first_expert = make_expert_mesh(make_mesh(dp_shard=4), 2)
    after_first = groups()
    second = make_mesh(dp_replicate=2, tp=2)
    second_expert = make_expert_mesh(make_mesh(dp_shard=4), 2)
    after_second = groups()
    other = make_mesh(dp_shard=2, tp=2)
    one = torch.ones((), device=common.device())
    dist_group = second["dp"].get_group()
    torch.distributed.all_reduce(one, group=dist_group)  # the reused mesh's groups still work
    return (after_first - before, after_second - after_first, first is second and first_expert is second_expert,
            other is not first, int(one))
