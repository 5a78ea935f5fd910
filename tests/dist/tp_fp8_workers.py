"""FP8 under tensor parallelism inside the engine: functions run on every rank by
tests/dist/test_tp_engine.py, on tp_engine_workers' stack (torch's ParallelStyles, FP8
styles for the FP8 linears): parity with the same recipe in one process, TP against pure
data parallelism, the bytes a sequence-parallel gather moves, and FP8 primary weights."""

from __future__ import annotations

import copy
import math
from typing import Dict

import torch
import torch.distributed as dist

import fsdp8

from . import common
from .tp_engine_workers import Stack, build, dp_of, errors, full_state, place, train

def _fp8_reference_step(reference, step: int, dp_size: int, vocab: int, opt, batch_per_rank: int = 2):
    """One step of the same FP8 recipe in one process: a forward per data-parallel slice (as
    each dp rank quantizes its own activations), gradients averaged."""
    x, y = common.global_batch(step, batch_per_rank * dp_size, 8, vocab)
    for r in range(dp_size):
        (reference(common.rank_slice(x, r, dp_size).to(common.device()),
                   common.rank_slice(y, r, dp_size).to(common.device())) / dp_size).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def fp8_parity(recipe_name: str, mesh_shape=(1, 2, 2), sequence_parallel: bool = False, steps: int = 3,
               dim: int = 32, hidden: int = 64, strategy: str = "optim_grads_params", compiled: bool = False,
               replicated_blocks: bool = False):
    """FP8 training with TP against the same recipe in one process, in lockstep: before each
    step the reference takes the engine's weights (see common.lockstep_errors for why); fp64
    compute (common.FP8_PARITY_PRECISION says why). ``compiled``: each block's forward compiled
    (aot_eager), the FP8 linears traced into it (fp8/tp_forward.py [Note: FP8 under TP, compiled]).
    ``replicated_blocks``: the blocks' linears whole on every rank (tp_engine_workers.place)."""
    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.fp8.recipes import recipe_from_name

    recipe = recipe_from_name(recipe_name)
    vocab = 32
    dp_replicate, dp_shard, tp = mesh_shape
    mesh = fsdp8.make_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    model = build(vocab, dim=dim, hidden=hidden)
    reference = copy.deepcopy(model).to(torch.float64)
    for block in reference.blocks:
        convert_to_fp8(block, recipe)
    place(model, mesh["tp"], sequence_parallel, replicated_blocks=replicated_blocks)
    sharded = fsdp8.fully_shard(model, mesh=mesh, strategy=strategy, fp8=recipe, precision=common.FP8_PARITY_PRECISION)
    if compiled:
        for block in sharded.blocks:
            block.forward = torch.compile(block.forward, backend="aot_eager", fullgraph=True)
    converted = sorted(n for n, m in sharded.named_modules() if isinstance(m, fsdp8.fp8.Float8Linear))
    # SGD with momentum, not Adam: Adam turns a near-zero gradient's rounding into a whole step
    # (a zero-initialised norm bias then differs by its full size), SGD keeps the weights'
    # errors at the gradients' level, which the tolerance bounds.
    opt = torch.optim.SGD(sharded.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    r, w = dp_of(mesh)
    worst: Dict[str, float] = {}
    for step in range(steps):
        with torch.no_grad():
            state = full_state(sharded)
            for name, p in reference.named_parameters():
                p.copy_(state[name])
        x, y = common.global_batch(step, 2 * w, 8, vocab)
        sharded(common.rank_slice(x, r, w).to(common.device()), common.rank_slice(y, r, w).to(common.device())).backward()
        fsdp8.clip_grad_norm_(sharded, 1.0)
        opt.step()
        opt.zero_grad()
        _fp8_reference_step(reference, step, w, vocab, ref_opt)
        for name, err in errors(full_state(sharded), {k: v.detach().cpu() for k, v in reference.state_dict().items()}).items():
            worst[name] = max(worst.get(name, 0.0), err)
    return worst, converted


def fp8_tp_vs_data_parallel(recipe_name: str, steps: int = 4, sequence_parallel: bool = True):
    """FP8 with tp over all ranks against the same recipe without TP on the same ranks (every
    rank fed the whole batch, so both equal one process), in lockstep: before each step the
    data-parallel run takes the TP run's weights and scaling state (delayed histories); fp64
    compute (common.FP8_PARITY_PRECISION says why)."""
    from fsdp8.fp8.recipes import recipe_from_name

    recipe = recipe_from_name(recipe_name)
    vocab = 32
    world = dist.get_world_size()
    tp_run = place(build(vocab, dim=32, hidden=64), fsdp8.make_mesh(dp_shard=1, tp=world)["tp"], sequence_parallel)
    tp_run = fsdp8.fully_shard(tp_run, mesh=fsdp8.make_mesh(dp_shard=1, tp=world), fp8=recipe,
                               precision=common.FP8_PARITY_PRECISION)
    dp_run = fsdp8.fully_shard(build(vocab, dim=32, hidden=64), fp8=recipe, precision=common.FP8_PARITY_PRECISION)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (tp_run, dp_run)]  # as fp8_parity
    worst: Dict[str, float] = {}
    for step in range(steps):
        dp_run.load_state_dict(full_state(tp_run))
        x, y = common.global_batch(step, 4, 8, vocab)
        for model, opt in zip((tp_run, dp_run), opts):
            model(x.to(common.device()), y.to(common.device())).backward()
            fsdp8.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
        for name, err in errors(full_state(tp_run), full_state(dp_run)).items():
            # Pending amaxes are each rank's own until the next step's all-reduce folds them
            # into the history (compared), so a tp piece's differ from a whole tensor's.
            if not name.endswith("fp8_amax_pending"):
                worst[name] = max(worst.get(name, 0.0), err)
    return worst


def fp8_sequence_parallel_bytes(recipe_name: str = "fp8-current", vocab: int = 32, batch: int = 2, seq: int = 8,
                                dim: int = 32, hidden: int = 64):
    """What travels over tp in one training step under sequence parallelism: every all-gather
    (fsdp8's and DTensor's) by dtype and bytes, and the FP8 layers' input gathers by label."""
    import torch.distributed._functional_collectives as funcol
    from fsdp8.distributed import comm
    name = "all_gather_single" if hasattr(funcol, "all_gather_single") else "all_gather_tensor"
    from fsdp8.fp8.recipes import recipe_from_name

    recipe = recipe_from_name(recipe_name) if recipe_name != "bf16" else None
    world = dist.get_world_size()
    mesh = fsdp8.make_mesh(dp_shard=1, tp=world)
    model = place(build(vocab, dim=dim, hidden=hidden), mesh["tp"], sequence_parallel=True)
    model = fsdp8.fully_shard(model, mesh=mesh, fp8=recipe)
    x, y = common.global_batch(0, batch, seq, vocab)
    model(x.to(common.device()), y.to(common.device())).backward()  # records the order; gathers settle
    gathers = []
    original_funcol, original_comm = getattr(funcol, name), comm.all_gather

    def counted_funcol(tensor, gather_dim, group, *a, **k):
        gathers.append(("dtensor", str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return original_funcol(tensor, gather_dim, group, *a, **k)

    def counted_comm(out, inp, group, label):
        if "sequence-parallel" in label:
            gathers.append(("fp8 input", str(inp.dtype), inp.numel() * inp.element_size()))
        return original_comm(out, inp, group, label)

    setattr(funcol, name, counted_funcol)
    comm.all_gather = counted_comm
    try:
        model(x.to(common.device()), y.to(common.device())).backward()
    finally:
        setattr(funcol, name, original_funcol)
        comm.all_gather = original_comm
    return gathers


def fp8_primary_tp(recipe_name: str = "fp8-current", steps: int = 3, vocab: int = 32):
    """fp8_init (FP8 primary weights) with TP at dp 2 x tp 2: the units keep FP8 shards and
    train as the same model converted after construction does."""
    from fsdp8.fp8.convert import fp8_init
    from fsdp8.fp8.recipes import recipe_from_name

    recipe = recipe_from_name(recipe_name)
    mesh = fsdp8.make_mesh(dp_shard=2, tp=2)
    torch.manual_seed(0)
    with torch.device("meta"), fp8_init(recipe):
        primary = Stack(vocab, dim=32, hidden=64)
    place(primary, mesh["tp"])
    torch.manual_seed(0)  # meta weights are drawn inside fully_shard from this RNG state
    a = fsdp8.fully_shard(primary, mesh=mesh)
    plain = build(vocab, dim=32, hidden=64)
    fsdp8.convert_to_fp8(plain, recipe, filter=lambda n, m: True)  # every linear, as fp8_init
    place(plain, mesh["tp"])
    b = fsdp8.fully_shard(plain, mesh=mesh)
    for model in (a, b):
        train(model, mesh, steps, vocab=vocab)
    return errors(full_state(a), full_state(b)), [getattr(u, "primary", None) for u in a._fsdp8.all_units]


# The activation-sized collectives of DTensor's redistributions, by op (the FP8 scale agreements are
# scalars, and the engine's own collectives are c10d calls outside the compiled graphs).
_ACTIVATION_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


def tp_compiled_collectives(precision: str, sequence_parallel: bool, family: str = "builtin"):
    """The collectives of one compiled training step of a tiny one-layer Llama (``family``: the built-in
    one, or "hf": Hugging Face's, planned from its own TP plan) at tp = world through
    ``fsdp8.parallelize`` (``precision``: "bf16" or an FP8 recipe name), read from every forward and
    backward graph AOTAutograd hands its compiler (a capturing backend around aot_eager's): the
    activation-sized ones (op, shape), sorted, how many collectives of any size, and the waits on them."""
    from torch._dynamo.backends.common import aot_autograd

    from fsdp8.fp8.recipes import recipe_from_name
    from fsdp8.models.llama import Llama, LlamaConfig

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    if family == "hf":
        import transformers

        hf_config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        model = transformers.LlamaForCausalLM(hf_config).to(common.device())
    else:
        model = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                  max_seq_len=16)).to(common.device())
    fp8 = None if precision == "bf16" else recipe_from_name(precision)
    config = fsdp8.ParallelConfig(tp=dist.get_world_size(), sequence_parallel=sequence_parallel, fp8=fp8,
                                  compile={"backend": aot_autograd(fw_compiler=capture, bw_compiler=capture)})
    model = fsdp8.parallelize(model, config)
    x, y = common.global_batch(0, 2, 16, 64)
    x, y = x.to(common.device()), y.to(common.device())
    (model(input_ids=x, labels=x).loss if family == "hf" else model(x, y)).backward()
    activations, collectives, waits = [], 0, 0
    for gm in graphs:
        for node in gm.graph.nodes:
            if getattr(node.target, "namespace", None) != "_c10d_functional":
                continue
            name = node.target.__name__.split(".")[0]
            if name == "wait_tensor":
                # Waits on this graph's own collectives; a wait on an input (the embedding's
                # reduce-scatter, an asynchronous tensor on NCCL) has no collective here to pair with.
                source = node.args[0]
                waits += getattr(getattr(source, "target", None), "namespace", None) == "_c10d_functional"
                continue
            collectives += 1
            shape = tuple(node.args[0].meta["val"].shape)
            if name in _ACTIVATION_COLLECTIVES and math.prod(shape) > 1:
                activations.append((name, shape))
    return sorted(activations), collectives, waits
