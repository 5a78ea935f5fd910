"""Checkpoint faults in one process: a killed save, a truncated or tampered checkpoint,
extra encoding, fsdp8 export."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import fsdp8
from fsdp8.checkpoint import CheckpointError, extra as extra_values, safetensors, store

SCRIPT = textwrap.dedent("""
    import sys, torch, fsdp8
    from tests.dist.common import UnevenModel
    torch.manual_seed(0)
    model = fsdp8.fully_shard(UnevenModel(vocab=9))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 9, (2, 8))
    for step in range(int(sys.argv[2])):
        model(x, x).backward(); opt.step(); opt.zero_grad()
    fsdp8.save(sys.argv[1], model, opt, extra={"step": int(sys.argv[2])})
""")


def _run(path, steps, fault=None):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    if fault:
        env["FSDP8_FAULT"] = fault
    return subprocess.run([sys.executable, "-c", SCRIPT, path, str(steps)], env=env, capture_output=True, text=True,
                          timeout=120)


def _model():
    from tests.dist.common import UnevenModel

    torch.manual_seed(5)
    model = fsdp8.fully_shard(UnevenModel(vocab=9))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    first, second = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    assert _run(first, 1).returncode == 0
    killed = _run(second, 2, fault="before_publish")
    assert killed.returncode == -9  # SIGKILL after writing its files, before publishing them
    assert fsdp8.latest(str(tmp_path)) == first
    assert not store.is_complete(second) and os.path.isdir(store.partial_path(second))
    model, opt = _model()
    assert fsdp8.load(first, model, opt)["step"] == 1
    with pytest.raises(CheckpointError, match="does not exist \\(a save was interrupted before it finished\\)"):
        fsdp8.load(second, model, opt)
    assert _run(second, 2).returncode == 0  # the next save clears the debris
    assert fsdp8.latest(str(tmp_path)) == second and not os.path.exists(store.partial_path(second))


def test_truncated_data_file_is_named(tmp_path):
    path = str(tmp_path / "c")
    assert _run(path, 1).returncode == 0
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    with open(os.path.join(path, data), "r+b") as f:
        f.truncate(10)
    model, opt = _model()
    with pytest.raises(CheckpointError, match=f"data file {data} is truncated"):
        fsdp8.load(path, model, opt)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-checkpoint",))


def test_metadata_is_never_unpickled_freely(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    assert _run(path, 1).returncode == 0
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    monkeypatch.chdir(tmp_path)
    model, opt = _model()
    with pytest.raises(CheckpointError, match="posix.system, which fsdp8 refuses to unpickle: the checkpoint may be malicious"):
        fsdp8.load(path, model, opt)
    assert not (tmp_path / "pwned-by-checkpoint").exists()


def test_missing_marker_means_interrupted(tmp_path):
    path = str(tmp_path / "c")
    assert _run(path, 1).returncode == 0
    os.remove(os.path.join(path, store.MARKER))
    model, opt = _model()
    with pytest.raises(CheckpointError, match="has no COMPLETE.json: the save that wrote it did not finish"):
        fsdp8.load(path, model, opt)
    assert fsdp8.latest(str(tmp_path)) is None


def test_optimizer_requested_but_not_saved(tmp_path):
    model, opt = _model()
    fsdp8.save(str(tmp_path / "c"), model)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        fsdp8.load(str(tmp_path / "c"), model, opt)


def test_extra_encoding_roundtrip():
    extra = {"step": 3, "rng": torch.get_rng_state(), "nested": [1.5, {"a": torch.arange(3)}], "name": "x", "none": None}
    back = extra_values.decode(extra_values.encode(extra))
    assert back["step"] == 3 and torch.equal(back["rng"], extra["rng"]) and torch.equal(back["nested"][1]["a"], torch.arange(3))
    with pytest.raises(TypeError, match="extra holds a set"):
        extra_values.encode({"bad": {1, 2}})


def test_export_cli_and_bad_keep_last(tmp_path):
    path = str(tmp_path / "c")
    assert _run(path, 1).returncode == 0
    out = subprocess.run([sys.executable, "-m", "fsdp8.cli", "export", path, str(tmp_path / "hf"), "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    f = safetensors.SafetensorsFile(str(tmp_path / "hf" / "model.safetensors"))
    assert "embed.weight" in f.names() and f.read("embed.weight").dtype == torch.bfloat16
    model, _ = _model()
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        fsdp8.save(str(tmp_path / "d"), model, keep_last=0)
