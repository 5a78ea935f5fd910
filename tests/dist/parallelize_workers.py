"""parallelize() on every rank: functions run by tests/dist/test_parallelize.py (module level, so workers import them).

Every run is compared with the same model trained in one process on the whole global batch
(SGD: see tp_workers.compare_training for why not Adam).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

import fsdp8
from fsdp8.models import ModelAdapter, register_adapter
from fsdp8.models.tp_plan import FamilyPlan, ReplicateParallel

from . import common

VOCAB, SEQ, ROWS, STEPS, LR = 128, 8, 8, 2, 0.5

# name -> ParallelConfig keyword arguments; the mesh sizes come from the layout.
# The references compute in fp32; parallelize's default would be bf16 on GPUs.
FP32 = fsdp8.Precision()
VARIANTS = {
    "plain": {},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "sp": {"sequence_parallel": True, "loss_parallel": True, "activation_checkpointing": "selective"},
    "offload": {"offload": "optim", "activation_checkpointing": "full"},
    "sp_full": {"sequence_parallel": True, "loss_parallel": True, "activation_checkpointing": "full"},
}
HF_FAMILIES = {  # family -> (config class, model class, config overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "attn_implementation": "eager"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
}


def hf_config(family: str):
    import transformers

    config_class, _, overrides = HF_FAMILIES[family]
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa")
    return getattr(transformers, config_class)(**{**fields, **overrides})


def build(family: str) -> nn.Module:
    """A tiny model (hidden 64, 2 layers, 4 heads, 2 kv heads, vocabulary 128), the same on every rank."""
    torch.manual_seed(0)
    if family == "builtin":
        from fsdp8.models.llama import Llama, LlamaConfig

        model = Llama(LlamaConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                  max_seq_len=16))
    else:
        import transformers

        model = getattr(transformers, HF_FAMILIES[family][1])(hf_config(family))
    return model.to(common.device())


def batch(family: str, step: int, rows: int = ROWS) -> Dict[str, torch.Tensor]:
    x, y = common.global_batch(step, rows, SEQ, VOCAB)
    if family == "builtin":
        return {"tokens": x, "targets": y}
    return {"input_ids": x, "labels": x}  # HF shifts the labels itself


def loss_of(model: nn.Module, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**{k: v.to(common.device()) for k, v in inputs.items()})
    return out if isinstance(out, torch.Tensor) else out.loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return common.full_tensor(t).detach().float().cpu()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.to(a.device)  # a reference may be kept on the GPU
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def reference_run(model: nn.Module, family: str) -> dict:
    """One process, the whole global batch: losses and gradients of every step, final weights."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"loss": [], "grads": []}
    for step in range(STEPS):
        loss = loss_of(model, batch(family, step))
        loss.backward()
        out["loss"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return out


def parallel_run(model: nn.Module, family: str, config: fsdp8.ParallelConfig, reference: dict) -> dict:
    """``model`` parallelized by ``config`` and trained like the reference: worst relative
    errors, the engine's all-gathers of the second step by unit, how often each decoder
    layer's first child ran in that step (2 = recomputed once), and where the rank stands."""
    model = fsdp8.parallelize(model, config)
    layer = model._fsdp8.units[0].module
    child = next(iter(layer.children()))
    calls: List[int] = []
    if not config.compiled:
        # Counting in a compiled layer would be a side effect inside the checkpoint that Dynamo
        # cannot trace: it would run the checkpointed layer eagerly, outside the graph under test.
        child.register_forward_hook(lambda *_: calls.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    gathers = None
    for step in range(STEPS):
        calls.clear()
        ctx = common.CountGathers() if step == 1 else contextlib.nullcontext()
        with ctx as counter, (loss_parallel() if config.loss_parallel else contextlib.nullcontext()):
            loss = loss_of(model, model.shard_batch(batch(family, step)))
            loss.backward()
        if step == 1:
            gathers, recomputed = counter.counts, (None if config.compiled else len(calls))
        fold_step_errors(worst, model, loss, reference, step)
        opt.step()
        opt.zero_grad()
    fold_weight_errors(worst, model, reference)
    tied = not hasattr(model, "lm_head") or not model.config.tie_word_embeddings or (
        model.lm_head.weight is model.get_input_embeddings().weight)
    return {"errors": worst, "gathers": gathers, "layer_calls": recomputed, "dp": (model.dp_rank, model.dp_size),
            "tied": tied, "class": type(model).__name__, "offloaded": getattr(model.memory_report(), "offloaded", None)}


def parity(family: str, layout: dict, variants: List[str]) -> dict:
    """Each variant of VARIANTS at ``layout`` (mesh sizes) against one reference run."""
    initial = build(family)
    reference = reference_run(copy.deepcopy(initial), family)
    return {name: parallel_run(copy.deepcopy(initial), family, fsdp8.ParallelConfig(**layout, **VARIANTS[name], precision=FP32),
                               reference)
            for name in variants}


def families(names: List[str]) -> dict:
    """Every installed family of ``names`` at dp 2 x tp 2, sequence parallel and selective
    checkpointing (the most that must fit together), or the error of a family for which the
    installed transformers gives no usable plan; families transformers lacks are left out."""
    import transformers

    out = {}
    for family in names:
        if not hasattr(transformers, HF_FAMILIES[family][1]):
            continue
        initial = build(family)
        reference = reference_run(copy.deepcopy(initial), family)
        try:
            out[family] = parallel_run(copy.deepcopy(initial), family,
                                       fsdp8.ParallelConfig(tp=2, **VARIANTS["sp"], precision=FP32), reference)
        except ValueError as e:
            out[family] = {"no plan": str(e)}
    return out


def reference_backward(reference: nn.Module, global_batch: Dict[str, torch.Tensor], dp_size: int,
                       own_loss: bool = False) -> float:
    """One process with data-parallel semantics: a forward and backward per data-parallel rank's
    rows (each quantizes its own activations; per-batch quantities are that rank's), the
    gradients and the returned loss averaged over the ranks. ``own_loss``: each backward starts
    from that rank's loss, as the rank's does, and the gradients are averaged after. Delayed
    scaling needs it: its scales are not rescaled with each tensor, so a 1/dp on the loss would
    change which output gradients fall among e5m2's subnormals."""
    ref_loss = 0.0
    for r in range(dp_size):
        part = loss_of(reference, {k: common.rank_slice(v, r, dp_size) for k, v in global_batch.items()})
        (part if own_loss else part / dp_size).backward()
        ref_loss += float(part.detach()) / dp_size
    if own_loss:
        for p in reference.parameters():
            if p.grad is not None:
                p.grad.div_(dp_size)
    return ref_loss


def fp8_parity(family: str, sequence_parallel: bool, checkpointing: str = "none", compiled: bool = False) -> Dict[str, float]:
    """FP8 current scaling at dp 2 x tp 2 (and ``checkpointing``) against the same recipe in one process, in lockstep
    (common.lockstep_errors says why): before each step the reference takes the parallel
    model's weights, then runs one forward per data-parallel slice (each dp rank quantizes its
    own activations) with the gradients averaged. Worst relative error of loss and gradients."""
    recipe = fsdp8.Float8CurrentScaling()
    initial = build(family)
    reference = copy.deepcopy(initial).to(torch.float64)  # fp64: common.FP8_PARITY_PRECISION says why
    config = fsdp8.ParallelConfig(tp=2, sequence_parallel=sequence_parallel, fp8=recipe,
                                  activation_checkpointing=checkpointing, precision=common.FP8_PARITY_PRECISION,
                                  compile={"backend": "aot_eager"} if compiled else False)
    model = fsdp8.parallelize(initial, config)
    for unit in model._fsdp8.units:
        fsdp8.convert_to_fp8(dict(reference.named_modules())[unit.name], recipe)
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, fsdp8.fp8.Float8Linear))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(STEPS):
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(_full(dict(model.named_parameters())[name]))
        global_batch = batch(family, step)
        loss = loss_of(model, model.shard_batch(global_batch))
        loss.backward()
        ref_loss = reference_backward(reference, global_batch, model.dp_size)
        total = _full(loss).to(common.device())  # NCCL reduces device tensors only
        dist.all_reduce(total)
        worst["loss"] = max(worst["loss"], abs(float(total) / dist.get_world_size() - ref_loss) / ref_loss)
        for name, p in reference.named_parameters():
            worst["grad"] = max(worst["grad"], _rel(_full(dict(model.named_parameters())[name].grad), _full(p.grad)))
        opt.step()
        opt.zero_grad()
        reference.zero_grad()
    return worst, converted


def from_checkpoint_directory(path: str, family: str = "qwen2") -> dict:
    """A save_pretrained directory, loaded two ways at dp 2 x tp 2: from_pretrained then
    parallelize, and built on the meta device, parallelized, filled by fsdp8.load_pretrained.
    Largest weight difference from the saved model and logits difference, for each."""
    import transformers

    if common.rank() == 0:
        build(family).save_pretrained(path)
    dist.barrier()
    saved = transformers.AutoModelForCausalLM.from_pretrained(path).to(common.device())
    tokens = batch(family, 0)["input_ids"].to(common.device())
    with torch.no_grad():
        logits = saved(input_ids=tokens).logits.float().cpu()
    direct = fsdp8.parallelize(transformers.AutoModelForCausalLM.from_pretrained(path),
                              fsdp8.ParallelConfig(tp=2, precision=FP32))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    torch.manual_seed(0)  # meta init draws on every rank (rank 0 drew more for the saved model)
    meta = fsdp8.parallelize(meta, fsdp8.ParallelConfig(tp=2, precision=FP32))
    fsdp8.load_pretrained(meta, path)
    out = {}
    for name, model in (("from_pretrained", direct), ("meta", meta)):
        state = {k: _full(v) for k, v in model.state_dict().items()}
        weights = max(float((state[k] - v.float().cpu()).abs().max()) for k, v in saved.state_dict().items())
        with torch.no_grad():
            got = model(input_ids=model.shard_batch({"input_ids": tokens})["input_ids"]).logits.float().cpu()
        rows = common.rank_slice(logits, model.dp_rank, model.dp_size)
        out[name] = {"weights": weights, "logits": float((got - rows).abs().max()),
                     "tied": model.lm_head.weight is model.get_input_embeddings().weight}
    return out


def packed_sequence_check() -> dict:
    """skip_packed_sequence_check at world 1: whether transformers' two checks were replaced,
    what each answers (original and replacement) for unpacked and packed position ids at
    batch size 1, and the largest difference of the model's logits before and after (the
    originals are put back at the end)."""
    import transformers.masking_utils as masking_utils
    import transformers.modeling_flash_attention_utils as flash_utils

    checks = {"flash": (flash_utils, "_is_packed_sequence", lambda fn, p: bool(fn(p, 1))),
              "mask": (masking_utils, "find_packed_sequence_indices", lambda fn, p: fn(p) is not None)}
    originals = {name: getattr(module, attr) for name, (module, attr, _) in checks.items()}
    model = build("llama")
    device = common.device()
    tokens = batch("llama", 0, rows=1)["input_ids"].to(device)
    unpacked = torch.arange(SEQ, device=device)[None]
    packed = torch.cat([torch.arange(3), torch.arange(SEQ - 3)])[None].to(device)
    with torch.no_grad():
        before = model(input_ids=tokens, position_ids=unpacked).logits
    try:
        # fp32 as before (automatic precision would be bf16 on a GPU): only the checks differ.
        model = fsdp8.parallelize(model, fsdp8.ParallelConfig(skip_packed_sequence_check=True,
                                                              precision=fsdp8.Precision()))
        with torch.no_grad():
            after = model(input_ids=tokens, position_ids=unpacked).logits
        replaced, answers = {}, {}
        for name, (module, attr, packed_answer) in checks.items():
            patched = getattr(module, attr)
            replaced[name] = patched is not originals[name] and patched.__wrapped__ is originals[name]
            answers[name] = {how: (packed_answer(fn, unpacked), packed_answer(fn, packed))
                             for how, fn in (("original", originals[name]), ("patched", patched))}
        return {"replaced": replaced, "answers": answers, "logits": float((after - before).abs().max())}
    finally:
        for name, (module, attr, _) in checks.items():
            setattr(module, attr, originals[name])


def bad_worlds(cases: List[tuple]) -> List[tuple]:
    """For each ``(family, ParallelConfig kwargs)`` that this world cannot run: parallelize's
    error (or None) and whether the model's parameters were left as they were (nothing was
    distributed before the error)."""
    out = []
    for family, kwargs in cases:
        model = nn.Sequential(nn.Linear(8, 8)).to(common.device()) if family == "mlp" else build(family)
        before = [id(p) for p in model.parameters()]
        try:
            fsdp8.parallelize(model, fsdp8.ParallelConfig(**kwargs))
            message = None
        except (ValueError, TypeError) as e:
            message = str(e)
        out.append((message, [id(p) for p in model.parameters()] == before))
    return out


def fold_step_errors(worst: Dict[str, float], model, loss, reference: dict, step: int) -> None:
    """Fold one step's relative errors into ``worst``: the ranks' mean loss (tp ranks hold the same
    loss, so the world's mean is the dp ranks') and every full gradient, against ``reference``'s."""
    total = _full(loss).to(common.device())  # NCCL reduces device tensors only
    dist.all_reduce(total)
    worst["loss"] = max(worst["loss"], abs(float(total) / dist.get_world_size() - reference["loss"][step])
                        / abs(reference["loss"][step]))
    for name, p in model.named_parameters():
        worst["grad"] = max(worst["grad"], _rel(_full(p.grad), reference["grads"][step][name]))


def fold_weight_errors(worst: Dict[str, float], model, reference: dict) -> None:
    """Fold the full weights' relative errors against ``reference["weights"]`` into ``worst``."""
    for name, p in model.named_parameters():
        worst["weight"] = max(worst["weight"], _rel(_full(p), reference["weights"][name]))


def compiled(family: str, options: dict, checkpointing: str = "selective", sequence_parallel: bool = False) -> dict:
    """Units compiled (``options`` for torch.compile) and checkpointed as ``checkpointing`` says, at dp 2 x tp 2;
    with Dynamo's graph breaks (a break inside a checkpoint runs the whole checkpointed layer eagerly)."""
    from torch._dynamo.utils import counters

    counters.clear()
    initial = build(family)
    reference = reference_run(copy.deepcopy(initial), family)
    config = fsdp8.ParallelConfig(tp=2, activation_checkpointing=checkpointing, compile=options, precision=FP32,
                                  sequence_parallel=sequence_parallel)
    return dict(parallel_run(copy.deepcopy(initial), family, config, reference),
                graph_breaks=sum(counters["graph_break"].values()))


def auto_layout(family: str = "builtin") -> dict:
    """parallelize(model, "auto"): the layout fsdp8.planner.search ranks first here, the same on
    every rank; its losses against the same layout given explicitly (equal) and against one
    process (meaningful where the layout computes in fp32, as on CPUs)."""
    from fsdp8.parallel.auto import auto_choice

    model = build(family)
    reference = reference_run(copy.deepcopy(model), family)
    expected = auto_choice(model).parallel

    def mean_losses(sharded) -> torch.Tensor:
        opt = torch.optim.SGD(sharded.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            loss = loss_of(sharded, sharded.shard_batch(batch(family, step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().float())
        total = torch.stack(losses)
        torch.distributed.all_reduce(total)
        return total.cpu() / torch.distributed.get_world_size()

    explicit = mean_losses(fsdp8.parallelize(copy.deepcopy(model), expected))
    sharded = fsdp8.parallelize(model, "auto")
    auto = mean_losses(sharded)
    chosen = sharded.parallel_config
    return {"chosen": repr(chosen), "matches_search": chosen == expected,
            "explicit_error": float((auto - explicit).abs().max()),
            "loss_error": float((auto - torch.tensor(reference["loss"])).abs().max())}


class Mixer(nn.Module):
    """A block of a model of one's own, held in no nn.ModuleList: fully_shard's default rule finds no unit."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class OwnModel(nn.Module):
    """(tokens, targets) -> loss, as the built-in Llama takes them (so batch("builtin", ...) feeds it)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.first, self.second = Mixer(dim), Mixer(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens, targets):
        logits = self.head(self.second(self.first(self.embed(tokens))))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class OwnAdapter(ModelAdapter):
    """OwnModel's family as a user would describe it; records what parallelize asked."""

    def __init__(self):
        self.asked: List[str] = []

    def claims(self, model: nn.Module) -> bool:
        return isinstance(model, OwnModel)

    def units(self, model: nn.Module):
        self.asked.append("units")
        return [Mixer]

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> FamilyPlan:
        self.asked.append("tp_plan")
        styles = {"embed": RowwiseParallel(input_layouts=Replicate()), "*.norm": ReplicateParallel(),
                  "*.up": ColwiseParallel(), "*.down": RowwiseParallel(),
                  "head": ColwiseParallel(output_layouts=Replicate())}
        return FamilyPlan(styles, vocab_modules=("embed", "head"))


@contextlib.contextmanager
def _registered(adapter: ModelAdapter):
    """``adapter`` registered inside the block only: the pool's workers serve later tests too."""
    from fsdp8.fp8 import swiglu_forms
    from fsdp8.models import adapter as registry

    saved = list(registry._REGISTERED), list(swiglu_forms._FORMS)
    register_adapter(adapter)
    try:
        yield
    finally:
        registry._REGISTERED[:], swiglu_forms._FORMS[:] = saved


def _unit_names(sharded: nn.Module) -> List[str]:
    names = {id(m): n for n, m in sharded.named_modules()}
    return [names[id(unit.module)] or "<root>" for unit in sharded._fsdp8.units]


def own_model() -> nn.Module:
    torch.manual_seed(0)
    return OwnModel().to(common.device())


def own_adapter() -> dict:
    """A model of one's own: what parallelize does with it before its family has an adapter (the
    generic one: its errors, fully_shard's default units), then at dp 2 x tp 2 with OwnAdapter
    registered (its units, its plan) against one process."""
    errors = {}
    for name, kwargs in (("tp", {"tp": 2}), ("cp", {"cp": 2})):
        try:
            fsdp8.parallelize(own_model(), fsdp8.ParallelConfig(**kwargs))
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    default_units = _unit_names(fsdp8.parallelize(own_model(), fsdp8.ParallelConfig(precision=FP32)))
    adapter = OwnAdapter()
    with _registered(adapter):
        initial = own_model()
        reference = reference_run(copy.deepcopy(initial), "builtin")
        model = copy.deepcopy(initial)  # parallelized in place by parallel_run
        run = parallel_run(model, "builtin", fsdp8.ParallelConfig(tp=2, precision=FP32), reference)
        on_tp = {name: repr(param.placements[param.device_mesh.mesh_dim_names.index("tp")])
                 for name, param in model.named_parameters() if name in ("first.up.weight", "first.down.weight")}
    return {"errors": errors, "default_units": default_units, "units": _unit_names(model), "asked": adapter.asked,
            "run": run, "on_tp": on_tp}


@contextlib.contextmanager
def _counting_tp_fp8_collectives(counts: Dict[str, int]):
    """Count the eager calls of fsdp8's tensor-parallel FP8 collectives into ``counts`` (keys
    "amax", "gather", "reduce_scatter"): scale agreements, FP8 sequence gathers and their input
    gradients' reduce-scatters."""
    from fsdp8.distributed import comm
    from fsdp8.fp8 import tp_gather

    originals = comm.all_reduce, comm.all_gather, tp_gather.reduce_scatter_sum

    def reduce(tensor, group, op, label):
        counts["amax"] += "tensor-parallel amax" in label
        return originals[0](tensor, group, op, label)

    def gather(out, inp, group, label):
        counts["gather"] += "sequence-parallel" in label
        return originals[1](out, inp, group, label)

    def scatter(*args):
        counts["reduce_scatter"] += 1
        return originals[2](*args)

    comm.all_reduce, comm.all_gather, tp_gather.reduce_scatter_sum = reduce, gather, scatter
    try:
        yield counts
    finally:
        comm.all_reduce, comm.all_gather, tp_gather.reduce_scatter_sum = originals


def compiled_fp8_tp_in_graph(family: str = "llama", checkpointing: str = "none") -> Dict[str, int]:
    """Compiled layers with FP8 current scaling at tp 2 with sequence parallelism, ``checkpointing`` as
    given, two training steps: Dynamo's graph breaks, the graphs it compiled, and the eager calls of fsdp8's
    tensor-parallel FP8 collectives, which a linear traced into the graph never makes. Counted from
    before the first compile, so the patch itself changes nothing Dynamo guards on."""
    from torch._dynamo.utils import counters

    counters.clear()
    with _counting_tp_fp8_collectives({"amax": 0, "gather": 0, "reduce_scatter": 0}) as eager:
        config = fsdp8.ParallelConfig(tp=dist.get_world_size(), sequence_parallel=True, fp8=fsdp8.Float8CurrentScaling(),
                                      precision=common.FP8_PARITY_PRECISION, compile={"backend": "aot_eager"},
                                      activation_checkpointing=checkpointing)
        model = fsdp8.parallelize(build(family), config)
        for step in range(2):
            loss_of(model, model.shard_batch(batch(family, step))).backward()
    return dict(eager, graph_breaks=sum(counters["graph_break"].values()), graphs=counters["stats"]["unique_graphs"])


def sequence_parallel_collectives(family: str = "llama", fp8: bool = True) -> Dict[str, int]:
    """The tensor-parallel collectives of the column-parallel layers' inputs in one training step
    (after one that settles the engine) at tp 2 with sequence parallelism, counted by label: with
    FP8 (current scaling) the FP8 sequence gathers, the amax agreements and the input gradients'
    reduce-scatters; without, DTensor's gathers of activations (3-D tensors)."""
    import torch.distributed._functional_collectives as funcol

    config = fsdp8.ParallelConfig(tp=dist.get_world_size(), sequence_parallel=True,
                                  fp8=fsdp8.Float8CurrentScaling() if fp8 else None,
                                  precision=common.FP8_PARITY_PRECISION)
    model = fsdp8.parallelize(build(family), config)
    loss_of(model, model.shard_batch(batch(family, 0))).backward()
    counts = {"gather": 0, "amax": 0, "reduce_scatter": 0, "dtensor_gather": 0}
    funcol_name = "all_gather_single" if hasattr(funcol, "all_gather_single") else "all_gather_tensor"
    original = getattr(funcol, funcol_name)

    def dtensor_gather(tensor, *args, **kwargs):
        counts["dtensor_gather"] += tensor.dim() == 3
        return original(tensor, *args, **kwargs)

    setattr(funcol, funcol_name, dtensor_gather)
    try:
        with _counting_tp_fp8_collectives(counts):
            loss_of(model, model.shard_batch(batch(family, 1))).backward()
    finally:
        setattr(funcol, funcol_name, original)
    counts["layers"] = len(model.model.layers)
    return counts
