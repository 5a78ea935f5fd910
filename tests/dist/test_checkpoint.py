"""Checkpoints: resharding across world sizes, strategies and meshes; interop; faults."""

import os

import pytest
import torch

from tests.harness import run_on_ranks
from tests.dist import ckpt_workers as cw

TOL = 1e-6  # fp32 parity with an uninterrupted single-process run, as in test_parity.py


def _max_err(a, b):
    """Largest per-tensor ||a - b|| / ||b|| (the metric and bound derived in test_parity.py)."""
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


@pytest.mark.parametrize("save_cfg,load_cfg", [
    ((2, "optim_grads_params", None, "no_shard"), (1, "optim_grads_params", None, "no_shard")),
    ((2, "optim_grads_params", None, "no_shard"), (4, "optim_grads_params", None, "no_shard")),
    ((2, "optim_grads_params", None, "no_shard"), (2, "optim", None, "no_shard")),
    ((4, "optim", None, "no_shard"), (2, "no_shard", None, "no_shard")),
    ((2, "no_shard", None, "no_shard"), (4, "optim_grads_params", None, "no_shard")),
    ((4, "optim_grads_params", None, "no_shard"), (4, "optim_grads_params", (2, 2), "no_shard")),
    ((4, "optim_grads_params", (2, 2), "optim"), (2, "optim_grads", None, "no_shard")),
    ((4, "optim", (2, 2), "no_shard"), (4, "optim_grads_params", (2, 2), "optim")),
], ids=lambda c: f"W{c[0]}-{c[1]}-{'x'.join(map(str, c[2])) if c[2] else 'flat'}-{c[3]}")
def test_reshard_and_continue(tmp_path, save_cfg, load_cfg):
    path = str(tmp_path / "ckpt")
    w_save, *save_args = save_cfg
    w_load, *load_args = load_cfg
    saved_params, saved_moments = run_on_ranks(w_save, cw.save_after, path, *save_args)[0]
    results = run_on_ranks(w_load, cw.load_and_continue, path, *load_args)
    (loaded_params, loaded_moments), after, step, _ = results[0]
    assert step == 2
    assert all(torch.equal(loaded_params[k], saved_params[k]) for k in saved_params)  # bit for bit
    assert all(torch.equal(loaded_moments[k], saved_moments[k]) for k in saved_moments)  # optimizer state too
    assert _max_err(after, run_on_ranks(1, cw.reference, 4)[0]) <= TOL  # training continues exactly
    # Each rank gets its own extra; ranks the saving run did not have get rank 0's.
    assert [r[3] for r in results] == [min(r, w_save - 1) if r < w_save else 0 for r in range(w_load)]


def test_plain_model_loads_fsdp8_checkpoint_with_dcp_alone(tmp_path):
    path = str(tmp_path / "ckpt")
    saved, _ = run_on_ranks(2, cw.save_after, path, "optim_grads_params")[0]
    plain = run_on_ranks(1, cw.load_into_plain, path)[0]
    assert all(torch.equal(plain[k], saved[k]) for k in saved)


def test_torch_fsdp2_roundtrip(tmp_path):
    into_fsdp8, into_fsdp2 = run_on_ranks(2, cw.fsdp2_roundtrip, str(tmp_path / "a"), str(tmp_path / "b"))[0]
    assert into_fsdp8 == 0.0 and into_fsdp2 == 0.0


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-block", "fp8-delayed"])
def test_fp8_primary_weights_and_histories_roundtrip(tmp_path, recipe):
    count, same_bytes, histories, same_hist = run_on_ranks(2, cw.fp8_roundtrip, str(tmp_path / "c"), recipe)[0]
    assert count > 0 and same_bytes
    assert same_hist and (histories > 0) == (recipe == "fp8-delayed")


def test_missing_file_named_on_every_rank(tmp_path):
    messages = run_on_ranks(2, cw.remove_file_then_load, str(tmp_path / "c"))
    for m in messages:
        assert m is not None and "cannot load checkpoint" in m
    assert any(".distcp is missing" in m for m in messages)


def test_a_damaged_item_fails_every_rank(tmp_path):
    messages = run_on_ranks(2, cw.flip_then_load, str(tmp_path / "c"))
    assert all(m is not None and "data file __1_0.distcp is damaged: bytes" in m for m in messages), messages


def test_a_save_failing_on_one_rank_fails_on_all(tmp_path):
    first, second = run_on_ranks(2, cw.save_unstorable_extra, str(tmp_path / "c"), timeout=60)
    assert first == "CheckpointError: could not write the extra values: another rank failed (its error says why)"
    assert second == "TypeError: extra holds a set; use JSON values and tensors"


def test_wrong_model_lists_keys(tmp_path):
    message = run_on_ranks(2, cw.load_wrong_model, str(tmp_path / "c"))[0]
    assert message is not None
    assert "missing keys" in message and "unexpected keys" in message and "blocks.0.up.weight" in message


def test_keep_last_rotation(tmp_path):
    names, latest = run_on_ranks(2, cw.rotation, str(tmp_path))[0]
    assert names == ["step-2", "step-3"]
    assert latest == os.path.join(str(tmp_path), "step-3")


def test_async_save(tmp_path):
    first_done, err, second_complete = run_on_ranks(2, cw.async_save, str(tmp_path / "a"), str(tmp_path / "b"))[0]
    assert first_done  # the second save waited for the first (at most one in flight)
    assert err == 0.0 and second_complete


@pytest.mark.parametrize("world", [1, 2])
def test_export_then_load_pretrained(tmp_path, world):
    for err, read, kept, total in run_on_ranks(world, cw.export_then_load_pretrained, str(tmp_path / "c"),
                                               str(tmp_path / "hf")):
        assert err == 0.0
        assert read == kept and (world == 1 or read < 0.6 * total)  # each rank reads its rows only
