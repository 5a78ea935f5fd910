"""FP8 functions run on every rank by the distributed tests (module-level so workers import them):
the engine's recipes against one process, gathered FP8 weights, delayed scaling's state, FP8
primary weights, compiled blocks (torch FSDP interop: fp8_fsdp_interop_workers.py)."""

from __future__ import annotations

import copy

import torch

import fsdp8

from . import common
from .workers import CountCollectives


def fp8_recipe(name):
    from fsdp8.fp8.recipes import recipe_from_name

    return recipe_from_name(name)


def fp8_parity(recipe_name, strategy="optim_grads_params", mesh_shape=None, outer="no_shard", steps=6, micro_batches=1):
    """The engine's FP8 training against the same recipe in one process (bf16 compute copies,
    standalone Float8Linears that quantize their bf16 weights)."""
    from fsdp8.fp8.convert import convert_to_fp8

    recipe = fp8_recipe(recipe_name)
    model = common.build_fp8_llama()
    reference = copy.deepcopy(model)
    for layer in reference.layers:
        convert_to_fp8(layer, recipe)
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer, fp8=recipe,
                                precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    kinds = sorted({type(m).__name__ for m in sharded.modules() if "Float8" in type(m).__name__})
    errors = common.lockstep_errors(sharded, reference, steps, torch.bfloat16, micro_batches=micro_batches)
    return errors, kinds


def fused_swiglu_runs(recipe_name, steps=2):
    """How many MLP forwards ran as one function (fp8/mlp.py) under the engine in ``steps``
    training steps, and how many decoder layers there are. (Checked where it runs: outside a
    forward the engine's parameters are DTensor shards, which would send the MLP to its own
    forward.)"""
    from fsdp8.fp8 import mlp

    calls = []
    original = mlp.float8_swiglu

    def counting(*args):
        calls.append(type(args[1].weight).__name__)
        return original(*args)

    mlp.float8_swiglu = counting
    try:
        model = common.build_fp8_llama()
        sharded = fsdp8.fully_shard(model, fp8=fp8_recipe(recipe_name),
                                    precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        common.train_sharded(sharded, steps)
    finally:
        mlp.float8_swiglu = original
    return calls, len(model.layers)


def fp8_gathered_weight(recipe_name, strategy="optim_grads_params", mesh_shape=None, outer="no_shard", dim=32, ffn=64):
    """Compare each gathered FP8 weight with quantizing the full (fp32-gathered) weight, after a
    step (every unit's scales agreed at once) and after only this unit changed; count bytes."""
    from fsdp8.fp8.tensor import Float8Tensor
    from fsdp8.models.llama import Llama, LlamaConfig

    recipe = fp8_recipe(recipe_name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4 * common.world() + 1, dim=dim, n_layers=2, n_heads=2, n_kv_heads=1,
                      ffn_dim=ffn, max_seq_len=16)
    model = Llama(cfg).to(common.device())
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer, fp8=recipe,
                                precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    common.train_sharded(sharded, 2)  # scales and weights after real optimizer steps
    unit = sharded._fsdp8.units[0]
    agreement = sharded._fsdp8.scales
    # Every unit changed: the scales are agreed for all units at once.
    first = _check_gathered_unit(unit, agreement, recipe)
    if "mismatch" in first:
        return first
    # Only this unit changed (its weights scaled in place): its scales alone, per unit.
    unit.reshard()
    # Bytes the resharded unit still holds for its gathered weights and their scale_inv.
    resharded_bytes = [unit.unsharded.untyped_storage().nbytes(), unit._scale_inv_flat.untyped_storage().nbytes()]
    with torch.no_grad():
        for slot in unit.slots:
            slot.main.mul_(1.5)
    second = _check_gathered_unit(unit, agreement, recipe)
    if "mismatch" in second:
        return second
    worst, checked, wire, counter = first["worst"], first["checked"], first["wire"], first["counter"]
    # Every unit's scales written in one go: one position per amax of every unit.
    batched = bool(agreement._layout) and agreement._layout[0].numel() == sum(u.amax_count() for u in agreement.units)
    # cuBLAS takes scale pointers on 16-byte boundaries only (CUBLAS_STATUS_NOT_SUPPORTED).
    from fsdp8.fp8.formats import Granularity

    agreed = recipe.w_granularity is not Granularity.MX_1x32  # MX weights keep their scale_inv only
    aligned = all(t.data_ptr() % 16 == 0 for s in unit.slots if isinstance(s.compute, Float8Tensor)
                  for t in ((unit.scale_of(s),) if agreed else ()) + (unit.scale_inv_of(s), s.compute._scale_inv))
    fp8_elems = sum(s.layout.numel for s in unit.slots if isinstance(s.compute, Float8Tensor))
    other_elems = sum(s.layout.numel for s in unit.slots if not isinstance(s.compute, Float8Tensor))
    scale_state = [unit._scale_flat, unit._scale_inv_flat, unit._scale_positions, unit._scale_picks]
    scale_state_bytes = sum(t.numel() * t.element_size() for t in scale_state if t is not None)
    return {"checked": checked, "other_max_err": worst, "wire_bytes": wire.bytes, "fp8_elems": fp8_elems,
            "scale_state_bytes": scale_state_bytes, "resharded_bytes": resharded_bytes,
            "scale_inv_bytes": unit._scale_inv_flat.numel() * 4,
            "scales_aligned": aligned, "batched_scales": batched, "checked_after_one_unit_changed": second["checked"],
            "other_elems": other_elems, "collectives": counter.counts, "world": common.world(),
            "padded_rows": [s.layout.chunk_rows * unit.layout.num_chunks - s.layout.rows for s in unit.slots]}


def _check_gathered_unit(unit, agreement, recipe):
    """Agree on scales, gather the unit, and compare each FP8 weight with quantizing the full
    (fp32-gathered) weight; other parameters with their bf16 rounding."""
    from fsdp8.fp8.kernels import quantize
    from fsdp8.fp8.tensor import Float8Tensor

    full = {s.fqn: s.main.full_tensor() for s in unit.slots}  # fp32 all-gather, for the check only
    agreement.refresh()
    with CountCollectives() as counter, common.CountGathers() as wire:
        unit.gather()
        unit.wait_gather()
    worst, checked = 0.0, 0
    for slot in unit.slots:
        if not isinstance(slot.compute, Float8Tensor):
            with torch.no_grad():
                got = slot.compute.float()
                worst = max(worst, float((got - full[slot.fqn].to(torch.bfloat16).float()).abs().max()))
            continue
        weight = full[slot.fqn].to(torch.bfloat16)
        if recipe.delayed:  # the scale comes from the weight's amax history
            state = slot.aliases[0][0]._delayed
            expected = quantize(weight, recipe.fwd_dtype, recipe.w_granularity, scale=state.scale[1])
        else:
            expected = quantize(weight, recipe.fwd_dtype, recipe.w_granularity)
        got = slot.compute.quantized()
        same_bytes = torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
        same_scales = torch.equal(got.scale_inv, expected.scale_inv)
        if not (same_bytes and same_scales):
            return {"mismatch": slot.fqn}
        checked += 1
    return {"worst": worst, "checked": checked, "wire": wire, "counter": counter}


def delayed_scaling_engine(steps=3):
    """Delayed scaling under the engine: one max all-reduce per step (fp8 amaxes) and
    identical histories on every rank, each holding the max over ranks of the amaxes."""
    from fsdp8.fp8.linear import Float8Linear
    from fsdp8.fp8.recipes import DelayedScaling

    recipe = DelayedScaling(amax_history_len=4)
    model = common.build_fp8_llama()
    sharded = fsdp8.fully_shard(model, fp8=recipe,
                                precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    common.train_sharded(sharded, 1, clip=0)
    linears = [m for m in sharded.modules() if isinstance(m, Float8Linear)]
    with CountCollectives() as counter:
        common.train_sharded(sharded, steps, clip=0)
        sharded._fsdp8.scales.refresh()  # fold the last step in, as the next forward would
    states = [m._delayed for m in linears]
    return {
        "all_reduces": counter.counts.get("all_reduce", 0),
        "history": torch.stack([s.history for s in states]).cpu(),
        "scale": torch.stack([s.scale for s in states]).cpu(),
        "external": all(m.external_delayed_update for m in linears),
    }


def fp8_primary(recipe_name, meta=True, steps=4):
    """fp8_init weights: same training as converting after construction; memory holds FP8
    shards and fp32 main chunks only; the kept init values are dropped."""
    import gc
    import weakref

    from fsdp8.fp8.convert import convert_to_fp8, fp8_init
    from fsdp8.models.llama import Llama

    recipe = fp8_recipe(recipe_name)
    cfg = common.build_fp8_llama().config
    prec = fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device("meta" if meta else common.device()), fp8_init(recipe):
        primary = Llama(cfg)
    kept = [weakref.ref(m.weight._hp_init) for m in primary.modules()
            if getattr(getattr(m, "weight", None), "_hp_init", None) is not None]
    torch.manual_seed(0)  # the meta model is initialized inside fully_shard, from this RNG state
    a = fsdp8.fully_shard(primary, precision=prec)
    torch.manual_seed(0)
    with torch.device(common.device()):
        plain = Llama(cfg)
    convert_to_fp8(plain, recipe, filter=lambda n, m: True)  # every linear, the head too, like fp8_init
    b = fsdp8.fully_shard(plain, precision=prec)
    gc.collect()
    alive = sum(r() is not None for r in kept)
    common.train_sharded(a, steps)
    common.train_sharded(b, steps)
    report = a.memory_report()
    fp8_elems = sum(s.layout.numel for u in a._fsdp8.all_units if hasattr(u, "fp8_ids") for s in u.slots if id(s) in u.fp8_ids)
    wire = sum(u.wire_layout.chunk_numel for u in a._fsdp8.all_units if getattr(u, "primary", False))
    return {"errors": common.relative_errors(a, b), "alive_hp": alive, "kept": len(kept),
            "compute_copies": report.compute_copies, "main": report.main_weights, "wire": wire,
            "fp8_elems": fp8_elems, "world": common.world(),
            "units_primary": [getattr(u, "primary", None) for u in a._fsdp8.all_units]}


def fp8_compiled_blocks(recipe_name, steps=3):
    """The engine's FP8 training with each block compiled against the same model in eager
    mode. Traceable recipes compile whole (fullgraph: a graph break fails); the others run
    as opaque calls inside the compiled blocks. Compute is fp64 (with the CPU emulation's
    fp64 GEMMs): the compiler rounds fused elementwise ops differently from eager by an ulp,
    and in fp32 such an ulp near an FP8 rounding boundary flips a byte downstream (seen on
    an AVX-512 Xeon: 1e-3 after three steps); in fp64 that chance is about 2^-49 per value."""
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # no compile worker pool inside a test worker

    from fsdp8.models.llama import Block

    recipe = fp8_recipe(recipe_name)
    models = []
    for compiled in (False, True):
        model = common.build_fp8_llama()
        sharded = fsdp8.fully_shard(model, strategy="optim_grads_params", fp8=recipe,
                                    precision=fsdp8.Precision(param_dtype=torch.float64, reduce_dtype=torch.float64))
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            for block in sharded.modules():
                if isinstance(block, Block):
                    block.forward = torch.compile(block.forward, fullgraph=recipe.traceable)
        models.append((sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-3, weight_decay=0.1)))
    (eager, eager_opt), (compiled, compiled_opt) = models
    errors, eager_losses, compiled_losses, delayed_errors = {}, [], [], []
    for step in range(steps):
        # Lockstep (as common.lockstep_errors): the compiled model starts each step from the
        # eager one's weights. The compiler's fused reductions round differently (on CUDA), and
        # one weight pushed across an FP8 rounding boundary would make the runs drift apart.
        with torch.no_grad():
            for eager_unit, compiled_unit in zip(eager._fsdp8.units, compiled._fsdp8.units):
                compiled_unit.main.copy_(eager_unit.main)
                compiled_unit.mark_stale()
        eager_losses += common.train_sharded(eager, 1, opt=eager_opt, first_step=step)
        compiled_losses += common.train_sharded(compiled, 1, opt=compiled_opt, first_step=step)
        for name, err in common.relative_errors(compiled, eager).items():
            errors[name] = max(errors.get(name, 0.0), err)
        if recipe.delayed:  # after this step's backward: its amaxes are pending
            delayed_errors.append(_delayed_differences(eager, compiled))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return {"errors": errors, "eager_losses": eager_losses, "compiled_losses": compiled_losses, "graphs": frames,
            "graph_breaks": breaks, "delayed_errors": delayed_errors}


def _delayed_differences(a, b):
    """The largest relative difference between the delayed states (amax histories, scales,
    pending amaxes) of two models with the same Float8Linears; None if they have none."""
    from fsdp8.fp8.linear import Float8Linear

    def buffers(model):
        states = [m._delayed for m in model.modules() if isinstance(m, Float8Linear) and m._delayed is not None]
        return [t for s in states for t in (s.history, s.scale, s.pending)]

    pairs = list(zip(buffers(a), buffers(b)))
    if not pairs:
        return None
    return max(float(((x - y).abs() / y.abs().clamp_min(1e-30)).max()) for x, y in pairs)


class _ResidualMLP(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _MLPStack(torch.nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ResidualMLP(dim) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def fp8_delayed_compiled_mlp(steps=4):
    """Delayed scaling under the engine, each block compiled (fullgraph), against the eager
    engine, on residual MLP blocks computing in fp64: every op of a block is exact or an
    fp64 GEMM of FP8 values (exact products), so the compiled blocks see the eager run's
    values and the FP8 bytes, amaxes, histories and scales must be equal bit for bit (a
    model with an fp32 norm, as the Llama, differs by the compiled norm's ulps). Weights in
    lockstep as fp8_compiled_blocks; returns per step the largest relative difference of
    the delayed states (0.0 when equal), the losses and the graph-break count."""
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    from fsdp8.fp8.recipes import DelayedScaling

    w, r = common.world(), common.rank()
    models = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _MLPStack().to(common.device())
        sharded = fsdp8.fully_shard(model, fp8=DelayedScaling(amax_history_len=4),
                                    precision=fsdp8.Precision(param_dtype=torch.float64, reduce_dtype=torch.float64))
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            for block in sharded.blocks:
                block.forward = torch.compile(block.forward, fullgraph=True)
        models.append((sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2)))
    (eager, _), (compiled, _) = models
    differences, losses = [], {False: [], True: []}
    for step in range(steps):
        with torch.no_grad():
            for eager_unit, compiled_unit in zip(eager._fsdp8.units, compiled._fsdp8.units):
                compiled_unit.main.copy_(eager_unit.main)
                compiled_unit.mark_stale()
        x = torch.randn(2 * w, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(step)) * (step + 1)
        x = common.rank_slice(x, r, w).to(common.device())
        for is_compiled, (model, opt) in zip((False, True), models):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[is_compiled].append(float(loss.detach()))
        differences.append(_delayed_differences(eager, compiled))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    scales = [m._delayed.scale for m in compiled.modules() if getattr(m, "_delayed", None) is not None]
    return {"differences": differences, "eager_losses": losses[False], "compiled_losses": losses[True],
            "graph_breaks": breaks, "graphs": graphs, "scaled": bool(scales) and all(s.ne(1).all() for s in scales)}
