"""Expert parallelism on every rank: functions run by tests/dist/test_ep.py (module level, so workers import them).

Every run is compared with the same model trained in one process with data-parallel
semantics: a forward per data-parallel rank's rows (the router's load-balancing loss is a
per-batch quantity, so each rank's rows make one batch, as under DDP), the losses averaged.
SGD with momentum (Adam would turn a near-zero gradient's rounding into a whole step).
"""

from __future__ import annotations

import copy
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp8
from fsdp8.models import adapter_for
from fsdp8.parallel import ep as ep_module
from fsdp8.parallel.ep import computed_in_fp8, rows_through_fp8

from . import common
from .parallelize_workers import _full, _rel, loss_of, reference_backward

VOCAB, SEQ, ROWS_PER_RANK, STEPS, LR = 64, 8, 2, 3, 0.1
FP32 = fsdp8.Precision()
# The built-in Llama's variants: (experts, router_aux_loss_coef). Under cp each rank's
# load-balancing loss covers its own chunk of the tokens (a per-batch quantity of another
# batch than one process's per-dp-rank rows), so the cp parity runs without it.
BUILTIN_EXPERTS = {"builtin": (8, 0.01), "builtin6": (6, 0.01), "dense": (0, 0.01), "builtin_noaux": (8, 0.0)}


def build(family: str) -> nn.Module:
    """A tiny mixture-of-experts model (8 experts, top 2, hidden 32), the same on every rank."""
    torch.manual_seed(0)
    if family in BUILTIN_EXPERTS:
        from fsdp8.models.llama import Llama, LlamaConfig

        model = Llama(LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                  max_seq_len=16, num_experts=BUILTIN_EXPERTS[family][0], num_experts_per_tok=2,
                                  moe_ffn_dim=16, router_aux_loss_coef=BUILTIN_EXPERTS[family][1]))
    else:
        import transformers

        common_fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2,
                             output_router_logits=True, router_aux_loss_coef=0.01, attn_implementation="sdpa")
        if family == "qwen3_moe":
            config = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                                 head_dim=8, **common_fields)
            model = transformers.Qwen3MoeForCausalLM(config)
        else:
            config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=8, head_dim=8, **common_fields)
            model = transformers.MixtralForCausalLM(config)
    return model.to(common.device())


def batch(family: str, step: int, rows: int) -> Dict[str, torch.Tensor]:
    x, y = common.global_batch(step, rows, SEQ, VOCAB)
    if family in BUILTIN_EXPERTS:
        return {"tokens": x, "targets": y}
    return {"input_ids": x, "labels": x}  # HF shifts the labels itself


def reference_run(model: nn.Module, family: str, dp: int, clip: float) -> dict:
    """One process: each step a forward per data-parallel rank's rows, losses averaged."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = {"loss": [], "grads": [], "norm": []}
    for step in range(STEPS):
        global_batch = batch(family, step, ROWS_PER_RANK * dp)
        total = 0.0
        for r in range(dp):
            loss = loss_of(model, {k: common.rank_slice(v, r, dp) for k, v in global_batch.items()}) / dp
            loss.backward()
            total += float(loss.detach())
        out["loss"].append(total)
        out["grads"].append({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()})
        out["norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return out


def parity(family: str, layout: dict, clip: float = 0.5, precision: fsdp8.Precision = FP32,
           one_process: Callable[[nn.Module], nn.Module] = lambda m: m) -> dict:
    """``family`` parallelized by ``ParallelConfig(**layout)`` against one process (the model as
    ``one_process`` makes it): worst relative errors of loss, gradients, the clipped norm and the
    final weights, and what each rank holds of the experts."""
    initial = build(family)
    config = fsdp8.ParallelConfig(**layout, precision=precision)
    model = fsdp8.parallelize(copy.deepcopy(initial), config)
    reference = reference_run(one_process(initial), family, model.dp_size, clip)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "weight": 0.0}
    for step in range(STEPS):
        # Compiled: after the first step nothing may recompile (the rows an expert receives change
        # in number every step; a graph that saw them would).
        with torch._dynamo.config.patch(error_on_recompile=bool(layout.get("compile")) and step > 0):
            loss = loss_of(model, model.shard_batch(batch(family, step, ROWS_PER_RANK * model.dp_size)))
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst["loss"] = max(worst["loss"], abs(float(total) / dist.get_world_size() - reference["loss"][step])
                            / abs(reference["loss"][step]))
        for name, p in model.named_parameters():
            worst["grad"] = max(worst["grad"], _rel(_full(p.grad), reference["grads"][step][name]))
        norm = float(fsdp8.clip_grad_norm_(model, clip))
        worst["norm"] = max(worst["norm"], abs(norm - reference["norm"][step]) / reference["norm"][step])
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        worst["weight"] = max(worst["weight"], _rel(_full(p), reference["weights"][name]))
    # How each expert weight is placed: {mesh dim: placement}.
    experts = {name: dict(zip(p.device_mesh.mesh_dim_names, map(str, p.placements)))
               for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))}
    return {"errors": worst, "experts": experts, "dp": (model.dp_rank, model.dp_size)}


def _experts_fed_fp8_rows(model: nn.Module) -> nn.Module:
    """``model`` in fp64 with each experts module computing on its input rounded as FP8 dispatch
    delivers it ([Note: FP8 dispatch]): the one process an ``fp8_dispatch`` run equals."""
    model = model.to(torch.float64)
    computed_in_fp8(model)  # transformers' experts take fsdp8's forward (theirs refuses fp64), as under ep
    for module in adapter_for(model).experts(model).values():
        def fed(hidden_states, *args, _forward=module.forward, **kwargs):
            return _forward(rows_through_fp8(hidden_states), *args, **kwargs)

        module.forward = fed
    return model


def fp8_dispatch_parity(family: str, ep: int) -> dict:
    """``parity`` of ``ParallelConfig(ep=ep, fp8_dispatch=True)`` in fp64 compute against one
    process whose experts take their input rounded to FP8, and what each dispatch all-to-all
    sent: (dtype, bytes per row) of the rows handed to it."""
    sent = []
    original = ep_module.comm.all_to_all

    def spy(out, inp, out_splits, in_splits, group, label):
        if label == "ep dispatch":
            sent.append((str(inp.dtype), inp.shape[1] * inp.element_size()))
        return original(out, inp, out_splits, in_splits, group, label)

    ep_module.comm.all_to_all = spy
    try:
        out = parity(family, {"ep": ep, "fp8_dispatch": True}, precision=common.FP8_PARITY_PRECISION,
                     one_process=_experts_fed_fp8_rows)
    finally:
        ep_module.comm.all_to_all = original
    return dict(out, sent=sorted(set(sent)))


def bad_config(family: str, layout: dict) -> str:
    """The error parallelize raises for ``layout`` (every rank must raise it, before any collective)."""
    try:
        fsdp8.parallelize(build(family), fsdp8.ParallelConfig(**layout, precision=FP32))
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _snapshot(model, opt) -> Dict[str, torch.Tensor]:
    """Full weights and AdamW moments, by name."""
    out = {f"model/{n}": _full(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"optim/{names[id(p)]}/{key}"] = _full(value)
    return out


def checkpoint_hop(family: str, path_in, path_out: str, layout: dict, first_step: int = 0) -> tuple:
    """Load ``path_in`` (if given) into ``family`` laid out by ``layout`` (a model from another
    seed: everything must come from the file), snapshot, train two AdamW steps, save."""
    torch.manual_seed(1 if path_in is None else 100)
    model = fsdp8.parallelize(build(family) if path_in is None else _reseeded(family),
                              fsdp8.ParallelConfig(**layout, precision=FP32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loaded = None
    if path_in is not None:
        first_step = int(fsdp8.load(path_in, model, opt)["step"])
        loaded = _snapshot(model, opt)
    for step in range(first_step, first_step + 2):
        loss_of(model, model.shard_batch(batch(family, step, ROWS_PER_RANK * model.dp_size))).backward()
        opt.step()
        opt.zero_grad()
    fsdp8.save(path_out, model, opt, extra={"step": first_step + 2})
    return loaded, _snapshot(model, opt)


def _reseeded(family: str) -> nn.Module:
    model = build(family)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=torch.Generator(device=p.device).manual_seed(7))
    return model


def load_pretrained_under_ep(family: str, path: str, layout: dict) -> Dict[str, float]:
    """A Hugging Face MoE checkpoint at ``path`` (rank 0 wrote it with save_pretrained) read by
    load_pretrained into a model of another init laid out by ``layout``: each rank reads its
    experts' rows. Returns the largest difference per weight against the file's model (0 is
    bit for bit)."""
    if dist.get_rank() == 0:
        build(family).save_pretrained(path)
    dist.barrier()
    saved = {n: p.detach().float().cpu() for n, p in build(family).named_parameters()}
    model = fsdp8.parallelize(_reseeded(family), fsdp8.ParallelConfig(**layout, precision=FP32))
    fsdp8.load_pretrained(model, path)
    return {n: float((_full(p) - saved[n]).abs().max()) for n, p in model.named_parameters()}


def _fp8_pair(family: str, layout: dict, recipe) -> tuple:
    """(the model parallelized by ``layout`` under ``recipe`` in fp64 compute, common.FP8_PARITY_PRECISION;
    the same model in one process, fp64, converted as the engine converts it)."""
    initial = build(family)
    reference = copy.deepcopy(initial).to(torch.float64)
    model = fsdp8.parallelize(initial, fsdp8.ParallelConfig(**layout, fp8=recipe,
                                                            precision=common.FP8_PARITY_PRECISION))
    computed_in_fp8(reference)  # transformers' experts get fsdp8's forward, as parallelize gives them
    for unit in model._fsdp8.units:  # the engine converts inside its units only (not the head)
        fsdp8.convert_to_fp8(dict(reference.named_modules())[unit.name], recipe)
    return model, reference


def fp8_block_parity(family: str, layout: dict) -> dict:
    """One step of 128-block FP8 scaling under expert parallelism against the same recipe in one
    process fed each data-parallel rank's rows (fp64 compute: common.FP8_PARITY_PRECISION).
    Row blocks of activations and gradients and each expert's 128x128 weight blocks do not
    depend on which rows share an expert's GEMM, so the loss and every gradient but the
    experts' weight gradients (whose token blocks follow the rows an expert received from its
    ep group) equal one process's up to fp64 rounding."""
    recipe = fsdp8.Float8BlockScaling()
    model, reference = _fp8_pair(family, layout, recipe)
    global_batch = batch(family, 0, ROWS_PER_RANK * model.dp_size)
    loss = loss_of(model, model.shard_batch(global_batch))
    loss.backward()
    ref_loss = reference_backward(reference, global_batch, model.dp_size)
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref_grads = {n: p.grad.detach().float().cpu() for n, p in reference.named_parameters()}
    grads = {n: _rel(_full(p.grad), ref_grads[n]) for n, p in model.named_parameters()}
    converted = sorted(n for n, m in model.named_modules() if getattr(m, "fp8_recipe", None) is not None)
    return {"loss": abs(float(total) / dist.get_world_size() - ref_loss) / abs(ref_loss), "grads": grads,
            "converted": converted, "experts": sorted(adapter_for(model).experts(model))}


def delayed_parity(family: str, layout: dict) -> dict:
    """Three SGD steps of delayed scaling, FP8 experts included, against the same recipe in one
    process fed each data-parallel rank's rows (fp64 compute: common.FP8_PARITY_PRECISION). The
    one process folds its amaxes in once a step, as the engine's per-step all-reduce does; each
    expert's history then holds the largest amax any rank saw, which is what one process records
    on all the rows. The engine gathers the dense linears' weights in 8 bits, each quantized with a
    history that took the weight's amax of now (fsdp8/engine/fp8_scales.py); the one process does
    the same before each step. Returns each step's loss error, the weights' errors after the last
    step, and the experts' histories and scales against the reference's."""
    from fsdp8.fp8.grouped_delayed import all_delayed_experts
    from fsdp8.fp8.recipes import W, update_delayed_states

    recipe = fsdp8.DelayedScaling(amax_history_len=4)
    model, reference = _fp8_pair(family, layout, recipe)
    ref_experts = all_delayed_experts(reference)
    ref_states = [s for e in ref_experts for s in e.states]
    dense = [m for m in reference.modules() if isinstance(m, fsdp8.fp8.Float8Linear)]
    for m in dense:
        m.external_delayed_update = True
        ref_states.append(m.delayed_state(torch.device("cpu")))
    for e in ref_experts:
        e.external_update = True

    def roll_reference():  # the engine's refresh before each step's first forward
        for m in dense:
            m._delayed.pending[W] = m.weight.detach().abs().max().float()
        update_delayed_states(ref_states)

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        global_batch = batch(family, step, ROWS_PER_RANK * model.dp_size)
        loss = loss_of(model, model.shard_batch(global_batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        roll_reference()
        ref_loss = reference_backward(reference, global_batch, model.dp_size, own_loss=True)
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(abs(float(total) / dist.get_world_size() - ref_loss) / abs(ref_loss))
    ref_params = dict(reference.named_parameters())
    weights = {n: _rel(_full(p), ref_params[n].detach().float().cpu()) for n, p in model.named_parameters()}
    model._fsdp8.scales.refresh()  # fold the last step in, on both sides
    roll_reference()
    experts = all_delayed_experts(model)
    histories = [_rel(e.history.cpu(), r.history) for e, r in zip(experts, ref_experts)]
    scales = [_rel(e.scale.cpu(), r.scale) for e, r in zip(experts, ref_experts)]
    moved = all(e.history[:, :, :STEPS].gt(0).any().item() for e in experts)
    return {"losses": losses, "weights": weights, "histories": histories, "scales": scales, "moved": moved,
            "experts": len(experts), "converted": sorted(n for n, m in model.named_modules()
                                                          if getattr(m, "fp8_recipe", None) is not None)}


def delayed_checkpoint_hop(path: str, save_layout: dict, load_layout: dict) -> dict:
    """Two delayed-scaling steps laid out by ``save_layout``, saved; a model from another seed laid
    out by ``load_layout`` loads it: each experts projection's histories and scales (buffers every
    rank holds whole) before and after, and whether the kept inverses follow the loaded scales."""
    from fsdp8.fp8.grouped_delayed import all_delayed_experts

    recipe = fsdp8.DelayedScaling(amax_history_len=4)
    config = dict(fp8=recipe, precision=FP32)
    model = fsdp8.parallelize(build("builtin"), fsdp8.ParallelConfig(**save_layout, **config))
    for step in range(2):
        loss_of(model, model.shard_batch(batch("builtin", step, ROWS_PER_RANK * model.dp_size))).backward()
    model._fsdp8.scales.refresh()  # the second step's amaxes into the histories
    saved = [(e.history.cpu().clone(), e.scale.cpu().clone()) for e in all_delayed_experts(model)]
    fsdp8.save(path, model)
    other = fsdp8.parallelize(_reseeded("builtin"), fsdp8.ParallelConfig(**load_layout, **config))
    fsdp8.load(path, other)
    loaded = [(e.history.cpu(), e.scale.cpu()) for e in all_delayed_experts(other)]
    inverses = all(torch.equal(s.scale_inv_column.cpu(), 1 / s.scale.cpu())
                   for e in all_delayed_experts(other) for s in e.states)
    return {"saved": saved, "loaded": loaded, "inverses": inverses,
            "moved": all(h[:, :, :2].gt(0).any() for h, _ in saved)}


def host_reads_per_moe_layer(recipe_name: str) -> float:
    """Device-to-host reads (``Tensor.tolist`` / ``.item``) in one training step's forward and
    backward at ep 2, per mixture-of-experts layer: the dispatch's split sizes and, with an FP8
    recipe, the local experts' row counts (its grouped GEMMs run group by group)."""
    from fsdp8.fp8.recipes import recipe_from_name

    recipe = recipe_from_name(recipe_name) if recipe_name != "bf16" else None
    model = fsdp8.parallelize(build("builtin"), fsdp8.ParallelConfig(ep=2, fp8=recipe, precision=FP32))
    loss_of(model, model.shard_batch(batch("builtin", 0, ROWS_PER_RANK * model.dp_size))).backward()
    reads = []
    originals = torch.Tensor.tolist, torch.Tensor.item

    def counted(original):
        def read(self, *args, **kwargs):
            reads.append(original.__name__)
            return original(self, *args, **kwargs)
        return read

    torch.Tensor.tolist, torch.Tensor.item = counted(originals[0]), counted(originals[1])
    try:
        loss_of(model, model.shard_batch(batch("builtin", 1, ROWS_PER_RANK * model.dp_size))).backward()
    finally:
        torch.Tensor.tolist, torch.Tensor.item = originals
    return len(reads) / model.config.n_layers


def router_on_plain_tensors(sequence_parallel: bool) -> dict:
    """A built-in MoE block laid out by ExpertParallelBlock over a 1-D tp mesh of every rank,
    forward and backward on one [batch, sequence] input, against the same block in one process:
    whether the router's top-k ever saw a DTensor (its backward fails on DTensors before torch
    2.12), the router weight's gradient placement, and the relative errors of the output, the
    load-balancing loss and the gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.overrides import TorchFunctionMode

    from fsdp8.models.llama import LlamaConfig
    from fsdp8.models.moe import MoE
    from fsdp8.models.tp_plan import ExpertParallelBlock

    class TopkInputs(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls, self.dtensor = 0, 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.topk:
                self.calls += 1
                self.dtensor += isinstance(args[0], DTensor)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                         num_experts=4, num_experts_per_tok=2, moe_ffn_dim=16, router_aux_loss_coef=0.1)
    dev = common.device()
    reference = MoE(config).to(dev)
    block = copy.deepcopy(reference)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3)).to(dev)
    out, aux = reference(x)
    (out.sum() + aux).backward()

    tp, r = common.world(), common.rank()
    mesh = init_device_mesh(dev.type, (tp,))
    parallelize_module(block, mesh, ExpertParallelBlock(sequence_parallel, use_local_output=True))
    seq = x.shape[1] // tp
    mine = DTensor.from_local(x[:, r * seq:(r + 1) * seq], mesh, [Shard(1)]) if sequence_parallel else x
    with TopkInputs() as seen:
        got, got_aux = block(mine)
        # Each rank's loss: its tokens' outputs and the (same) load-balancing loss of the whole rows.
        (got.sum() + got_aux).backward()
    expected = out[:, r * seq:(r + 1) * seq] if sequence_parallel else out
    grads = {}
    for (name, p), ref in zip(block.named_parameters(), reference.parameters()):
        if isinstance(p.grad, DTensor):
            grads[name] = _rel(common.full_tensor(p.grad), ref.grad)
            continue
        if sequence_parallel:  # the plain experts' gradients of this rank's tokens: summed over tp, as the engine does
            dist.all_reduce(p.grad)
        grads[name] = _rel(p.grad, ref.grad)
    # A deep copy's router reads the copy's parameters (its gradient lands there, not on the original's).
    placements = [type(p).__name__ for p in block.gate.weight.grad.placements]
    block.zero_grad(set_to_none=True)
    twin = copy.deepcopy(block)
    sum(t.sum() for t in twin(mine)).backward()
    copies_own = twin.gate.weight.grad is not None and block.gate.weight.grad is None
    return {"topk_calls": seen.calls, "topk_on_dtensor": seen.dtensor, "router_grad": placements, "copy_uses_its_own": copies_own,
            "out": _rel(got, expected), "aux": _rel(got_aux, aux), "grads": grads}
