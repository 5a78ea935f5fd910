"""Engine behaviour beyond parity: collective counts, memory, init, checks, state dicts, clipping."""

from __future__ import annotations

import math

import pytest

from tests.harness import run_on_ranks
from tests.dist import workers

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


# -- collectives ---------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_world_size_one_issues_no_collective(strategy, precision):
    counts = run_on_ranks(1, workers.no_collectives_at_world_one, strategy, precision)[0]
    assert counts == {}


def test_collectives_per_step_zero3():
    counts, units = run_on_ranks(2, workers.collective_counts, "optim_grads_params")[0]
    # Forward: one all-gather per unit (the root and the last unit of forward keep their
    # parameters for backward); backward: one all-gather per resharded unit and one
    # reduce-scatter per unit; nothing else.
    resharded = units - 2
    assert counts == {"all_gather": units + resharded, "reduce_scatter": units}


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_collectives_per_step_zero12(strategy):
    counts, units = run_on_ranks(2, workers.collective_counts, strategy)[0]
    # Compute copies persist: one refresh all-gather per unit after the step, one reduce-scatter.
    assert counts == {"all_gather": units, "reduce_scatter": units}


def test_collectives_per_step_no_shard():
    counts, units = run_on_ranks(2, workers.collective_counts, "no_shard")[0]
    assert counts == {"all_reduce": units}


@pytest.mark.parametrize("strategy,expected", [
    # ZeRO-1 keeps unsharded gradients: 3 micro-batches, one reduce-scatter per unit.
    ("optim", lambda u: {"all_gather": u, "reduce_scatter": u}),
    # ZeRO-3 reduce-scatters every micro-batch into the fp32 shards; params gathered twice per
    # pass, except the root and the last unit of forward in backward.
    ("optim_grads_params", lambda u: {"all_gather": 3 * (2 * u - 2), "reduce_scatter": 3 * u}),
])
def test_collectives_with_no_sync(strategy, expected):
    counts, units = run_on_ranks(2, workers.collective_counts, strategy, 3)[0]
    assert counts == expected(units)


def test_hsdp_no_sync_defers_replica_all_reduce():
    counts, units = run_on_ranks(4, workers.collective_counts, "optim_grads_params", 3, (2, 2))[0]
    assert counts == {"all_gather": 3 * (2 * units - 2), "reduce_scatter": 3 * units, "all_reduce": units}


# -- memory ----------------------------------------------------------------------------------
def _formula(shapes, units, strategy, mesh_shape, outer, main=4, compute=2, reduce=4):
    """Bytes per rank from first principles (independent of fsdp8's layout code)."""
    replicate, shard = (mesh_shape if mesh_shape else (1, None))
    inner_sharded = strategy != "no_shard"
    outer_sharded = outer == "optim"
    n = (shard if inner_sharded else 1) * (replicate if outer_sharded else 1)
    main_b = grads_b = copies = acc = largest = 0
    for names in units:
        chunk = sum(math.ceil(shapes[p][0][0] / n) * math.prod(shapes[p][0][1:]) for p in names)
        trainable = sum(math.ceil(shapes[p][0][0] / n) * math.prod(shapes[p][0][1:]) for p in names if shapes[p][1])
        main_b += chunk * main
        grads_b += trainable * main
        if strategy == "optim_grads_params":
            largest = max(largest, n * chunk * compute)
            if outer_sharded:
                copies += replicate * chunk * compute
        else:
            copies += n * chunk * compute
        if strategy in ("no_shard", "optim"):
            acc += n * trainable * reduce
    return main_b, grads_b, copies, acc, largest


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mesh_shape,outer", [((4,), "no_shard"), ((2, 2), "no_shard"), ((2, 2), "optim")])
def test_memory_report_matches_formula_and_storages(strategy, mesh_shape, outer):
    out = run_on_ranks(4, workers.memory_report, strategy, mesh_shape if len(mesh_shape) == 2 else None, outer)[0]
    shape = mesh_shape if len(mesh_shape) == 2 else (1, 4)
    expected = _formula(out["shapes"], out["units"], strategy, shape, outer)
    assert out["report"] == expected
    assert out["measured"] == expected[:4]


def test_memory_report_fp32_no_shard_has_no_copy():
    out = run_on_ranks(2, workers.memory_report, "no_shard", None, "no_shard", "fp32")[0]
    main, grads, copies, acc, largest = out["report"]
    assert copies == 0 and largest == 0  # compute parameters alias the main weights
    assert out["measured"][2] == 0


# -- initialization and checks -------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("tied", [False, True])
def test_meta_device_init(strategy, tied):
    for init_errors, train_errors, tied_ok, rotary_finite in run_on_ranks(2, workers.meta_init, strategy, tied):
        assert max(init_errors.values()) == 0.0, init_errors
        assert max(train_errors.values()) <= 1e-6, train_errors
        assert tied_ok and rotary_finite


def test_meta_init_needs_same_rng_everywhere():
    messages = run_on_ranks(2, workers.meta_rng_desync)
    for m in messages:
        assert m is not None and "rng=" in m and "torch.manual_seed" in m and "rank 0 and rank 1" in m


def test_structure_desync_raises_on_every_rank():
    messages = run_on_ranks(2, workers.structure_desync)
    for m in messages:
        assert m is not None
        assert "embed.weight (9, 17)" in m and "(10, 17)" in m


def test_mesh_must_cover_world():
    for message in run_on_ranks(2, workers.bad_mesh):
        assert message is not None and "covers 1 ranks, but the world has 2" in message


# -- state dict --------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,mesh_shape,outer", [
    ("optim_grads_params", None, "no_shard"),
    ("optim", None, "no_shard"),
    ("no_shard", None, "no_shard"),
    ("optim_grads_params", (2, 2), "optim"),
])
def test_state_dict_roundtrip(strategy, mesh_shape, outer):
    for keys_ok, kinds, back_to_init, restored, loss_after, loss_ref in run_on_ranks(4, workers.state_dict_roundtrip, strategy, mesh_shape, outer):
        assert keys_ok
        assert all(kinds[k] == "DTensor" for k in kinds if not k.startswith("rotary")), kinds
        assert back_to_init == 0.0
        assert restored == 0.0
        assert abs(loss_after - loss_ref) <= 1e-6 * abs(loss_ref)


def test_state_dict_errors_list_everything():
    message, missing, unexpected = run_on_ranks(2, workers.state_dict_errors)[0]
    assert message is not None
    for needle in ("missing keys (2)", "norm.weight", "layers.0.attn.wq.weight", "unexpected keys (1)",
                   "layers.9.ffn.w1.weight", "mis-shaped keys (1)", "embed.weight: checkpoint (3, 3) vs model (9, 16)"):
        assert needle in message, (needle, message)
    assert missing == ["norm.weight"] and unexpected == []


# -- clipping ------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("strategy,mesh_shape,outer", [
    ("optim_grads_params", None, "no_shard"),
    ("no_shard", None, "no_shard"),
    ("optim_grads", (2, 2), "optim"),
    ("optim", (2, 2), "no_shard"),
])
def test_clip_grad_norm_is_global(norm_type, strategy, mesh_shape, outer):
    for ours, theirs, clipped in run_on_ranks(4, workers.clip_norms, strategy, norm_type, mesh_shape, outer):
        assert abs(ours - theirs) <= 1e-5 * theirs
        assert clipped <= 1e-5


# -- order, casting, meta materialization ---------------------------------------------------------
def test_prefetch_follows_recorded_execution_order():
    forward, backward, issued, errors = run_on_ranks(2, workers.recorded_order)[0]
    assert forward == ["blocks.2", "blocks.1", "blocks.0"]
    assert backward == ["blocks.0", "blocks.1", "blocks.2"]
    # Iteration 1 records the order: each unit gathered as it runs, and all three again in
    # backward. Iteration 2 gathers each unit one ahead of its use, in the recorded order;
    # backward gathers again, also one ahead, all but blocks.0: the last unit of forward
    # keeps its parameters for backward, which starts with it.
    first, second = issued[:9], issued[9:]
    assert first[:6] == ["gather blocks.2", "run blocks.2", "gather blocks.1", "run blocks.1", "gather blocks.0", "run blocks.0"]
    assert sorted(first[6:]) == ["gather blocks.0", "gather blocks.1", "gather blocks.2"]
    assert second[:6] == ["gather blocks.2", "gather blocks.1", "run blocks.2", "gather blocks.0", "run blocks.1", "run blocks.0"]
    assert second[6:] == ["gather blocks.1", "gather blocks.2"]
    assert max(errors.values()) <= 1e-6


def test_root_inputs_cast_to_param_dtype():
    seen, out_dtype = run_on_ranks(1, workers.input_cast)[0]
    assert seen == [("torch.bfloat16", "torch.bfloat16")] and out_dtype == "torch.bfloat16"


def test_meta_init_holds_one_module_at_a_time():
    log, total = run_on_ranks(2, workers.meta_never_full)[0]
    assert len(log) == 6
    for real, own in log:
        assert real == own < total  # only the module being initialized is materialized in full


@pytest.mark.parametrize("world", [1, 2])
def test_forward_before_backward_gathers_fresh_weights(world):
    errors = run_on_ranks(world, workers.forward_before_backward)[0]
    assert max(errors.values()) <= 1e-5, errors


def test_one_rank_packs_gradients_where_they_land():
    # With nothing to communicate, each of the biggest units packs its fp32 gradients into
    # the buffer its main gradients then view: one allocation of that size per unit, not a
    # pack buffer and a landing buffer.
    sizes, largest, units = run_on_ranks(1, workers.reduce_allocations, "optim_grads_params")[0]
    assert units >= 1 and sizes == [largest] * units, (sizes, largest, units)
    # Across two ranks the reduce-scatter's input (the whole unit, twice the shard) and its
    # output (the landing buffer) are two buffers.
    sizes, largest, units = run_on_ranks(2, workers.reduce_allocations, "optim_grads_params")[0]
    assert sorted(sizes) == [largest] * units + [2 * largest] * units, (sizes, largest, units)
