"""FP8 inside the sharding engine: 8-bit all-gathers, agreed scales, training parity.

Parity bound: the reference is the same recipe in one process (bf16 compute copies whose
Float8Linears quantize the bf16 weight with the full weight's amax, one forward per rank
slice). The engine quantizes its fp32 main rows through bf16 with the all-reduced amax, so
FP8 bytes, scales and emulated GEMMs are identical; only the fp32 order of the gradient sum
differs, as in the bf16 parity tests (measured ~3e-8), hence the same 1e-5 bound. Because
one weight moved across an FP8 rounding boundary by that order difference makes the runs
drift apart (a whole FP8 step in one byte; 1e-4 after a few steps), the reference takes
the engine's weights before each step (common.lockstep_errors) and the bound applies to
every step.
"""

import pytest
import torch

from tests.harness import run_on_ranks
from tests.dist import fp8_fsdp_interop_workers
from tests.dist import fp8_workers as workers

TOL = 1e-5
RECIPES = ["fp8-current", "fp8-block", "fp8-mxfp8"]


def _check(results):
    for errors, kinds in results:
        assert kinds, "no Float8Linear in the model"
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, bad


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_training_parity(world, recipe):
    _check(run_on_ranks(world, workers.fp8_parity, recipe))


@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-current"])
def test_block_scaling_runs_each_mlp_as_one_function_under_the_engine(recipe):
    """Under fully_shard, every SwiGLU MLP's forward takes the fused function with block
    scaling (on the engine's gathered FP8 weights), and none with current scaling; the parity
    test above holds its values to the reference's."""
    for calls, layers in run_on_ranks(2, workers.fused_swiglu_runs, recipe):
        if recipe == "fp8-block":
            assert len(calls) == 2 * layers and set(calls) == {"Float8Tensor"}, calls
        else:
            assert calls == []


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_fp8_parity_other_strategies(strategy):
    _check(run_on_ranks(2, workers.fp8_parity, "fp8-current", strategy))


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block"])
def test_fp8_hsdp_parity(recipe, outer):
    _check(run_on_ranks(4, workers.fp8_parity, recipe, "optim_grads_params", (2, 2), outer))


def test_fp8_no_sync_parity():
    _check(run_on_ranks(2, workers.fp8_parity, "fp8-block", "optim_grads_params", None, "no_shard", 4, 3))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", RECIPES + ["fp8-delayed"])
def test_gathered_fp8_weight_and_payload(world, recipe):
    out = run_on_ranks(world, workers.fp8_gathered_weight, recipe)[0]
    assert "mismatch" not in out, out
    assert out["checked"] == 7 and out["other_max_err"] == 0.0
    assert out["checked_after_one_unit_changed"] == 7
    assert out["scales_aligned"]
    # Per-tensor and 128x128 scales of all units are agreed and written in one go.
    assert out["batched_scales"] == (recipe in ("fp8-current", "fp8-block"))
    assert out["collectives"] == {"all_gather": 1}  # one all-gather for the whole unit
    if recipe == "fp8-mxfp8":
        # MX keeps one fp32 scale_inv per 32 weight elements (7 weights, each padded to 4
        # floats) and nothing else: no agreed scale, no index maps into the agreement.
        assert out["scale_state_bytes"] <= 4 * out["fp8_elems"] // 32 + 7 * 16
        # ...which, made from the gathered e8m0 bytes, is freed with the gathered weights.
        assert out["resharded_bytes"] == [0, 0]
    else:  # agreed before the gather, so kept
        assert out["resharded_bytes"] == [0, out["scale_inv_bytes"]]
    scales = out["fp8_elems"] // 32 if recipe == "fp8-mxfp8" else 0  # e8m0 bytes travel with MX
    # 1 byte per FP8 weight element (+ MX scales), 2 per bf16 element (+ under 16 bytes per chunk
    # to keep chunks 16-byte aligned); a bf16 gather would be 2 for all.
    exact = out["fp8_elems"] + scales + 2 * out["other_elems"]
    assert exact <= out["wire_bytes"] < exact + 16 * out["world"]
    assert out["wire_bytes"] < 0.55 * 2 * (out["fp8_elems"] + out["other_elems"])


@pytest.mark.parametrize("dim,ffn", [(256, 384), (64, 80)])
@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-current", "fp8-mxfp8"])
def test_fp8_blocks_straddling_shards_and_uneven_rows(recipe, dim, ffn):
    # 256 rows over 4 ranks: every 128-row block spans two shards; 80 rows: 20 per rank.
    out = run_on_ranks(4, workers.fp8_gathered_weight, recipe, "optim_grads_params", None, "no_shard", dim, ffn)[0]
    assert "mismatch" not in out, out
    assert out["checked"] == 7


def test_fp8_hsdp_outer_optim_gather():
    out = run_on_ranks(4, workers.fp8_gathered_weight, "fp8-block", "optim_grads_params", (2, 2), "optim")[0]
    assert "mismatch" not in out, out


def test_delayed_scaling_one_all_reduce_per_step_and_same_history():
    results = run_on_ranks(2, workers.delayed_scaling_engine, 3)
    first = results[0]
    assert first["external"]
    # One fp8 amax all-reduce per step (plus one per clip-free step? none: clip=0) and the final fold-in.
    assert first["all_reduces"] == 3 + 1
    for other in results[1:]:
        assert torch.equal(other["history"], first["history"]) and torch.equal(other["scale"], first["scale"])
    history = first["history"]
    assert (history[:, :, :4] > 0).all()  # x, w and dy amaxes recorded in each of the last 4 steps


@pytest.mark.parametrize("meta", [True, False])
@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block", "fp8-mxfp8"])
def test_fp8_primary_weights(recipe, meta):
    out = run_on_ranks(2, workers.fp8_primary, recipe, meta)[0]
    # Same bytes and steps as converting a normally built model: identical training.
    assert max(out["errors"].values()) == 0.0
    assert all(out["units_primary"])
    if not meta:
        assert out["kept"] > 0 and out["alive_hp"] == 0  # init values seeded the main shards, then were dropped
    # Between steps a rank holds its fp32 main chunk and its packed FP8 shard, nothing in bf16
    # or fp32 besides: the persistent compute copies are exactly the FP8 shard bytes (plus the
    # few norm weights, 2 bytes each), about a quarter of the main chunk.
    assert out["compute_copies"] == out["wire"]
    assert out["fp8_elems"] // out["world"] <= out["wire"] < 0.3 * out["main"]


# -- torch FSDP interop ------------------------------------------------------------------------
@pytest.mark.parametrize("precompute", [True, False])
def test_fsdp2_trains_with_8bit_all_gather(precompute):
    """Exact parity with the single-process FP8 run: FSDP2 gathers the same FP8 bytes."""
    out = run_on_ranks(2, fp8_fsdp_interop_workers.fsdp2_fp8_interop, 4, precompute)[0]
    assert out["wrapped"] == 14 and out["sharded_ok"]
    assert out["dtype"] == "torch.uint8" and out["pre_calls"] == 14 * 4 * 2  # forward and backward gathers
    assert max(out["errors"].values()) <= TOL


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_fp8_uneven_and_empty_shards(world):
    # 17x17 weights over 4 ranks (5,5,5,2 rows) and a 3-row weight (1,1,1,0 rows: an empty shard).
    out = run_on_ranks(world, fp8_fsdp_interop_workers.fsdp2_fp8_interop, 4, True, "uneven")[0]
    assert out["wrapped"] == 6 and out["dtype"] == "torch.uint8"
    assert max(out["errors"].values()) <= TOL


def test_amax_reduction_group_keeps_delayed_histories_equal():
    with_group = run_on_ranks(2, fp8_fsdp_interop_workers.delayed_group_reduce, True)
    without = run_on_ranks(2, fp8_fsdp_interop_workers.delayed_group_reduce, False)
    assert torch.equal(with_group[0], with_group[1])
    assert not torch.equal(without[0], without[1])  # each rank saw different activations
    # Step 0 ran with scales 1 in both runs, so its amaxes (history column 1 after two updates)
    # are the max over the ranks' own; later steps diverge through the scales.
    assert torch.equal(with_group[0][:, :, 1], torch.maximum(without[0], without[1])[:, :, 1])


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block", "fp8-mxfp8"])
def test_fp8_compiled_blocks_match_eager(recipe):
    """Float8Linears in torch.compile'd blocks (traced: quantization generated by the
    compiler, and MX's exact dequantization where its GEMM is emulated) train like the eager
    engine, step by step from equal weights (lockstep, see the worker). fp64 compute: both quantize the same values with the
    same formulas, and no ulp of difference in the compiler's fused ops reaches an FP8
    rounding boundary; measured ~3e-8 per step on CPU (the fp32 main weights), so the
    parity bound holds."""
    for out in run_on_ranks(2, workers.fp8_compiled_blocks, recipe):
        assert out["graphs"] >= 1
        assert max(out["errors"].values()) <= TOL, out["errors"]
        assert out["compiled_losses"] == pytest.approx(out["eager_losses"], rel=TOL)


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_delayed_compiled_blocks_equal_eager(world):
    """Delayed scaling traced into compiled blocks (fullgraph: no graph break): the blocks
    quantize x, w and dy with the scale buffers and fold their amaxes into the pending
    buffers on the device (dy's in the compiled backward), while the engine's step
    all-reduce and history roll run as in eager. On blocks whose ops are exact in fp64 (see
    the worker) the compiled run's amax histories, scales and pending amaxes equal the eager
    run's bit for bit after every step, and so do the losses."""
    for out in run_on_ranks(world, workers.fp8_delayed_compiled_mlp, 4):
        assert out["graphs"] >= 1 and out["graph_breaks"] == 0
        assert out["scaled"]  # x, w and dy scales all came from recorded histories
        assert out["differences"] == [0.0] * 4
        assert out["compiled_losses"] == out["eager_losses"]


def test_fp8_delayed_compiled_llama_blocks_match_eager():
    """The same on the Llama's blocks, whose fp32 RMSNorm the compiler rounds differently by
    an ulp or two: the linears' inputs, so their amaxes, differ by that (measured 1.5e-7
    relative), and histories and scales stay within the parity bound, as the weights do."""
    for out in run_on_ranks(2, workers.fp8_compiled_blocks, "fp8-delayed", 4):
        assert out["graphs"] >= 1 and out["graph_breaks"] == 0
        assert max(out["delayed_errors"]) <= TOL, out["delayed_errors"]
        assert max(out["errors"].values()) <= TOL, out["errors"]
        assert out["compiled_losses"] == pytest.approx(out["eager_losses"], rel=TOL)
