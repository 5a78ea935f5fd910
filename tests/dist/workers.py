"""Functions run on every rank by the distributed tests (module-level so workers import them)."""

from __future__ import annotations

import copy

import torch

import fsdp8

from . import common


# -- collectives -------------------------------------------------------------------------
COLLECTIVES = (
    "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
    "all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "reduce_scatter", "all_to_all_single",
)


class CountCollectives:
    """Counts every torch.distributed collective called while active (by kind)."""

    def __init__(self):
        self.counts = {}
        self._saved = {}

    def __enter__(self):
        import torch.distributed as dist

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*a, __name=name, __orig=original, **k):
                kind = "all_gather" if __name.startswith("all_gather") else "reduce_scatter" if __name.startswith("reduce_scatter") else __name
                self.counts[kind] = self.counts.get(kind, 0) + 1
                return __orig(*a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        return False


def collective_counts(strategy, micro_batches=1, mesh_shape=None, outer="no_shard"):
    """Collectives of the second training step (the first one records the order)."""
    model = common.build("llama")
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer)
    common.train_sharded(sharded, 1, micro_batches=micro_batches, clip=0)
    with CountCollectives() as counter:
        common.train_sharded(sharded, 1, micro_batches=micro_batches, clip=0)
    return counter.counts, len(sharded._fsdp8.all_units)


def no_collectives_at_world_one(strategy, precision):
    """At world size 1 nothing may reach torch.distributed after set-up."""
    model = common.build("llama")
    prec = fsdp8.Precision() if precision == "fp32" else fsdp8.Precision(param_dtype=torch.bfloat16)
    with CountCollectives() as counter:
        sharded = fsdp8.fully_shard(model, strategy=strategy, precision=prec)
        common.train_sharded(sharded, 3, micro_batches=2)
    return counter.counts


# -- memory ------------------------------------------------------------------------------
def memory_report(strategy, mesh_shape=None, outer="no_shard", precision="bf16"):
    """The report, the same numbers measured from live storages, and the layout-free formula."""
    model = common.build("llama")
    shapes = {n: (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()}
    prec = fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else fsdp8.Precision()
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer, precision=prec)
    common.train_sharded(sharded, 1)
    report = sharded.memory_report()
    x, y = common.global_batch(0, 2, 8, common.vocab_of(sharded))
    sharded(x.to(common.device()), y.to(common.device())).backward()  # grads present for the measurement
    measured_main = _storage_bytes([p._local_tensor for p in sharded.parameters()])
    measured_grads = _storage_bytes([p.grad._local_tensor for p in sharded.parameters() if p.grad is not None])
    units = sharded._fsdp8.all_units
    measured_copies = _storage_bytes([u.unsharded for u in units if not u.aliased and not u.shards_params]
                                     + [u.outer_cache for u in units if u.outer_cache is not None])
    measured_acc = _storage_bytes([u.grad_acc for u in units if u.grad_acc is not None])
    return {
        "report": (report.main_weights, report.grads, report.compute_copies, report.grad_accumulation, report.largest_unsharded_unit),
        "measured": (measured_main, measured_grads, measured_copies, measured_acc),
        "shapes": shapes,
        "units": [sorted(n for n in u_names) for u_names in _unit_param_names(sharded)],
    }


def _storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _unit_param_names(sharded):
    return [[s.fqn for s in u.slots] for u in sharded._fsdp8.all_units]


# -- initialization ------------------------------------------------------------------------
def meta_init(strategy, tied):
    """A model built on meta equals the same-seed CPU model after fully_shard, then trains in parity."""
    from fsdp8.models.llama import Llama

    cfg = common.build("llama", tie_embeddings=tied).config
    torch.manual_seed(0)
    with torch.device(common.device()):  # same RNG stream as materializing on this device
        cpu_model = Llama(cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = Llama(cfg)
    sharded = fsdp8.fully_shard(meta_model, strategy=strategy)
    init_errors = common.relative_errors(sharded, cpu_model)
    tied_ok = (not tied) or sharded.head.weight is sharded.embed.weight
    reference = copy.deepcopy(cpu_model)
    common.train_sharded(sharded, 5)
    common.train_reference(reference, 5)
    return init_errors, common.relative_errors(sharded, reference), tied_ok, torch.isfinite(sharded.rotary.cos).all().item()


def meta_rng_desync():
    """Meta init with different RNG states per rank must fail on every rank, before any collective hangs."""
    from fsdp8.models.llama import Llama

    cfg = common.build("llama").config
    torch.manual_seed(common.rank())
    with torch.device("meta"):
        model = Llama(cfg)
    try:
        fsdp8.fully_shard(model)
    except fsdp8.distributed.DesyncError as e:
        return str(e)
    return None


def structure_desync():
    """Rank-dependent model shapes fail on every rank with the first difference named."""
    model = common.UnevenModel(vocab=9 + common.rank(), dim=17)
    try:
        fsdp8.fully_shard(model)
    except fsdp8.distributed.DesyncError as e:
        return str(e)
    return None


# -- state dict and clipping ---------------------------------------------------------------------
def state_dict_roundtrip(strategy, mesh_shape=None, outer="no_shard"):
    model = common.build("llama")
    reference = copy.deepcopy(model)
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer)
    common.train_sharded(sharded, 2)
    sd = {k: v.clone() for k, v in sharded.state_dict().items()}  # state_dict() shares storage
    keys_ok = sorted(sd) == sorted(reference.state_dict())
    kinds = {k: type(v).__name__ for k, v in sd.items()}
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}
    # Load the reference's (untrained) full tensors, then our own DTensors back.
    sharded.load_state_dict(reference.state_dict())
    back_to_init = max(common.relative_errors(sharded, reference).values())
    sharded.load_state_dict(sd)
    restored = max(float((sharded.state_dict()[k].full_tensor() - full[k]).abs().max()) for k in full if kinds[k] == "DTensor")
    # Training continues correctly after a load: the compute copies were refreshed.
    x, y = common.global_batch(0, 2, 8, common.vocab_of(sharded))
    x, y = x.to(common.device()), y.to(common.device())
    loss_after = float(sharded(x, y).detach())
    reference.load_state_dict(full)
    loss_ref = float(reference(x, y).detach())
    return keys_ok, kinds, back_to_init, restored, loss_after, loss_ref


def state_dict_errors():
    model = common.build("llama")
    sharded = fsdp8.fully_shard(model)
    sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sharded.state_dict().items()}
    bad = dict(sd)
    bad.pop("norm.weight")
    bad.pop("layers.0.attn.wq.weight")
    bad["layers.9.ffn.w1.weight"] = torch.zeros(3)
    bad["embed.weight"] = torch.zeros(3, 3)
    try:
        sharded.load_state_dict(bad)
    except fsdp8.engine.StateDictError as e:
        message = str(e)
    else:
        message = None
    result = sharded.load_state_dict({k: v for k, v in sd.items() if k != "norm.weight"}, strict=False)
    return message, list(result.missing_keys), list(result.unexpected_keys)


def clip_norms(strategy, norm_type, mesh_shape=None, outer="no_shard"):
    model = common.build("llama")
    reference = copy.deepcopy(model)
    sharded = fsdp8.fully_shard(model, mesh=common.mesh(mesh_shape), strategy=strategy, outer_strategy=outer)
    w, r = common.world(), common.rank()
    x, y = common.global_batch(0, 2 * w, 8, common.vocab_of(sharded))
    x, y = x.to(common.device()), y.to(common.device())
    sharded(common.rank_slice(x, r, w), common.rank_slice(y, r, w)).backward()
    reference(x, y).backward()
    ours = float(fsdp8.clip_grad_norm_(sharded, 1e-3, norm_type))
    theirs = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3, norm_type))
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    clipped = max(float((grads[n] - p.grad).norm() / p.grad.norm()) for n, p in reference.named_parameters())
    return ours, theirs, clipped


# -- bad input needing several ranks -----------------------------------------------------------
def bad_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    partial = DeviceMesh(common.device().type, [0])
    try:
        fsdp8.fully_shard(common.build("uneven"), mesh=partial)
    except ValueError as e:
        return str(e)
    return None


# -- order, casting, meta materialization ----------------------------------------------------
class ReversedModel(torch.nn.Module):
    """Runs its blocks in the reverse of their definition order."""

    def __init__(self, vocab):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 17)
        self.blocks = torch.nn.ModuleList([common.UnevenBlock() for _ in range(3)])
        self.head = torch.nn.Linear(17, vocab)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in reversed(self.blocks):
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def recorded_order():
    """The prefetch order is the execution order of the first iteration, not definition order."""
    torch.manual_seed(0)
    model = ReversedModel(common.vocab_of(None)).to(common.device())
    reference = copy.deepcopy(model)
    sharded = fsdp8.fully_shard(model)
    schedule = sharded._fsdp8.schedule
    issued = []
    for unit in schedule.units:
        original = unit.gather

        def logged(unit=unit, original=original):
            if unit.needs_gather():
                issued.append(f"gather {unit.name}")
            original()

        unit.gather = logged
        # Runs after fsdp8's own pre-forward hook (which is prepended): marks the unit's use.
        unit.module.register_forward_pre_hook(lambda m, a, name=unit.name: issued.append(f"run {name}"))
    common.train_sharded(sharded, 2)
    common.train_reference(reference, 2)
    forward = [u.name for u in schedule.forward_order]
    backward = [u.name for u in schedule.backward_order]
    return forward, backward, issued, common.relative_errors(sharded, reference)


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = []

    def forward(self, x, extra=None):
        self.seen.append((x.dtype, None if extra is None else extra.dtype))
        return self.lin(x)


def input_cast():
    """Floating inputs of the root forward are cast to param_dtype; integer inputs are left alone."""
    model = Probe().to(common.device())
    sharded = fsdp8.fully_shard(model, precision=fsdp8.Precision(param_dtype=torch.bfloat16))
    out = sharded(torch.randn(2, 4, device=common.device()), extra=torch.ones(2, device=common.device()))
    return [(str(a), str(b)) for a, b in model.seen], str(out.dtype)


class Watcher(torch.nn.Linear):
    """Records, at each reset_parameters call, how many parameter elements are real (not meta)."""

    log = []

    def reset_parameters(self):
        super().reset_parameters()
        root = Watcher.root
        if root is not None:
            real = sum(p.numel() for p in root.parameters() if not p.is_meta and type(p).__name__ != "DTensor"
                       and not hasattr(p, "_local_tensor"))
            Watcher.log.append((real, self.weight.numel() + self.bias.numel()))


Watcher.root = None


def meta_never_full():
    Watcher.log = []
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[Watcher(32, 32) for _ in range(6)])
    Watcher.root = model
    fsdp8.fully_shard(model, units=[Watcher])
    Watcher.root = None
    return Watcher.log, sum(32 * 32 + 32 for _ in range(6))


def forward_before_backward():
    """Forwards that do not follow a backward: (forward, backward, forward, step, forward,
    backward, step), then two forwards whose summed loss takes one backward. The units kept
    gathered for backward (the root, the last unit) must not carry weights from before a step."""
    torch.manual_seed(0)
    model = common.build("llama")
    reference = copy.deepcopy(model).to(common.device())
    sharded = fsdp8.fully_shard(model)
    w, r = common.world(), common.rank()
    vocab = common.vocab_of(reference)

    def batch(step, ranks):
        x, y = common.global_batch(step, 2 * w, 8, vocab)
        if ranks:
            x, y = common.rank_slice(x, r, w), common.rank_slice(y, r, w)
        return x.to(common.device()), y.to(common.device())

    def run(model, sliced):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model(*batch(0, sliced)).backward()  # records the order
        opt.step()
        opt.zero_grad()
        model(*batch(1, sliced)).backward()
        model(*batch(2, sliced))  # no backward: its graph is dropped
        opt.step()  # with step 1's gradients
        opt.zero_grad()
        model(*batch(3, sliced)).backward()
        opt.step()
        opt.zero_grad()
        (model(*batch(4, sliced)) + model(*batch(5, sliced))).backward()
        opt.step()

    run(sharded, True)
    run(reference, False)
    return common.relative_errors(sharded, reference)


class LargeAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of every fp32 tensor of at least ``least`` elements that
    aten allocates while active."""

    ALLOCATORS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                  torch.ops.aten.empty_like.default, torch.ops.aten.zeros.default,
                  torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default}

    def __init__(self, least: int):
        super().__init__()
        self.least, self.sizes = least, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ALLOCATORS and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            if out.numel() >= self.least:
                self.sizes.append(out.numel())
        return out


def reduce_allocations(strategy):
    """fp32 buffers at least the size of the biggest unit's gradient shard allocated during
    one backward (the second step's: the first records the order), with bf16 compute and
    fp32 reduction; that
    size; how many units have it."""
    model = common.build("llama")
    precision = fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = fsdp8.fully_shard(model, strategy=strategy, precision=precision)
    common.train_sharded(sharded, 1, clip=0)
    largest = max(u.layout.trainable_numel for u in sharded._fsdp8.all_units)
    x, y = common.global_batch(1, 2 * common.world(), 8, common.vocab_of(sharded))
    x, y = common.rank_slice(x, common.rank(), common.world()), common.rank_slice(y, common.rank(), common.world())
    loss = sharded(x.to(common.device()), y.to(common.device()))
    with LargeAllocations(largest) as seen:
        loss.backward()
    biggest = sum(u.layout.trainable_numel == largest for u in sharded._fsdp8.all_units)
    return seen.sizes, largest, biggest
