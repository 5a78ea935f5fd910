"""FP8 experts' weights all-gathered as 8-bit bytes (fsdp8/engine/fp8_experts.py) against the
same training with them gathered in the compute dtype and quantized at every call (gloo, the
built-in moe-tiny Llama, 2 layers).

Both runs quantize each expert's matrix with the same per-expert scales into the same bytes,
and every other operation is the same, so losses, gradients and weights are equal bit for bit.
At world 2 with ep 2 each experts unit is one chunk (efsdp 1): no gather, the bytes are packed
in place; its expert scales are still agreed with the other ep rank's zeros around them."""

from __future__ import annotations

import math

import pytest

from tests.dist import fp8_experts_workers as workers
from tests.harness import run_on_ranks


@pytest.mark.parametrize("recipe,layout", [("fp8-current", {}), ("fp8-current", {"ep": 2}), ("fp8-block", {}),
                                           ("fp8-current", {"strategy": "optim_grads"}), ("fp8-mxfp8", {}),
                                           ("fp8-mxfp8", {"ep": 2})],
                         ids=["current-dp2", "current-ep2", "block-dp2", "current-dp2-zero2", "mxfp8-dp2",
                              "mxfp8-ep2"])
def test_fp8_experts_gathered_in_8_bits_equal_the_high_precision_gather(recipe, layout):
    for out in run_on_ranks(2, workers.wire_parity, recipe, layout):
        assert out["differences"] == [], out["differences"][:10]
        assert out["experts"] == 2 and len(out["converted"]) == 2, out["converted"]
        assert out["kinds"] == ["Float8Tensor"], out["kinds"]  # the experts compute with the gathered bytes
        # One byte per expert weight element where bf16 took two, gathered and held (each chunk
        # of a unit's wire padded to 16 bytes), plus MX's e8m0 scale bytes.
        own_units = "ep" in layout  # experts are units of their own under ep
        assert set(out["experts_numel"]) == ({"layers.0.ffn.experts", "layers.1.ffn.experts"} if own_units
                                             else {"layers.0", "layers.1"}), out["experts_numel"]
        for unit, numel in out["experts_numel"].items():
            slack = 16 * out["chunks"][unit]
            old, new = out["held"][unit]
            saving = numel - out["e8m0"][unit]
            assert abs((old - new) - saving) < slack, (unit, old, new, saving)
            if out["chunks"][unit] > 1:
                saved = out["old_gathered"][unit] - out["new_gathered"][unit]
                gathers = out["new_gathered"][unit] // new  # forward and backward (ZeRO-3), forward (ZeRO-2)
                assert gathers == (1 if layout.get("strategy") else 2), gathers
                assert abs(saved - gathers * saving) < gathers * slack, (unit, saved, saving)


def test_compiled_units_trace_fp8_experts_with_the_same_results():
    """Traced into the compiled units (no graph break at the experts), the experts' FP8 GEMMs give
    the opaque calls' losses, gradients and weights bit for bit. (Under ep the dispatch and the
    experts run outside the graphs: fsdp8/parallel/ep.py.)"""
    for out in run_on_ranks(2, workers.compiled_parity, {}):
        assert out["differences"] == [], out["differences"][:10]
        assert out["breaks"][0] == 0 < out["breaks"][1], out["breaks"]  # traced: none; opaque: at the experts


def test_delayed_experts_in_compiled_units_train_as_eager():
    """Delayed scaling's experts are an opaque call inside compiled units: losses, gradients,
    weights and the experts' histories equal the eager run's bit for bit."""
    for out in run_on_ranks(2, workers.delayed_compiled_parity, {}):
        assert out["differences"] == [], out["differences"][:10]
        assert out["moved"] and out["histories_equal"] and all(out["histories_equal"]), out


def test_delayed_experts_of_a_meta_device_model_start_fresh():
    # Materialization gives meta buffers uninitialized memory: the histories must not start from it.
    for out in run_on_ranks(2, workers.delayed_meta_init):
        assert out["experts"] == 4 and out["fresh"] and out["moved"], out
        assert all(math.isfinite(x) for x in out["losses"]), out["losses"]


@pytest.mark.parametrize("layout", [{}, {"ep": 2}], ids=["dp2", "ep2"])
def test_delayed_experts_add_no_collective(layout):
    # Current scaling agrees its weights' scales in one all-reduce a step; delayed scaling folds
    # every history, the experts' included, into that same one (the README's claim).
    for out in run_on_ranks(2, workers.amax_all_reduces, layout):
        assert out["delayed"] == out["current"] >= 1, out

