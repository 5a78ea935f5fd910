"""Checkpoint faults in one process: a killed save, a truncated or tampered checkpoint,
extra encoding, fsdp8 export."""

import io
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

import fsdp8
from fsdp8.checkpoint import CheckpointError, checksums, extra as extra_values, safetensors, store
from fsdp8.checkpoint.safe_io import read_metadata_safely

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
    assert fsdp8.checkpoint.latest(str(tmp_path)) == first
    assert not store.is_complete(second) and os.path.isdir(store.partial_path(second))
    model, opt = _model()
    assert fsdp8.load(first, model, opt)["step"] == 1
    with pytest.raises(CheckpointError, match="does not exist \\(a save was interrupted before it finished\\)"):
        fsdp8.load(second, model, opt)
    assert _run(second, 2).returncode == 0  # the next save clears the debris
    assert fsdp8.checkpoint.latest(str(tmp_path)) == second and not os.path.exists(store.partial_path(second))


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
    assert fsdp8.checkpoint.latest(str(tmp_path)) is None


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
    out = subprocess.run([sys.executable, "-m", "fsdp8", "export", path, str(tmp_path / "hf"), "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    f = safetensors.SafetensorsFile(str(tmp_path / "hf" / "model.safetensors"))
    assert "embed.weight" in f.names() and f.read("embed.weight").dtype == torch.bfloat16
    model, _ = _model()
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        fsdp8.save(str(tmp_path / "d"), model, keep_last=0)


def _saved(tmp_path, name="c", **kwargs):
    model, opt = _model()
    path = str(tmp_path / name)
    fsdp8.save(path, model, opt, extra={"step": 1}, **kwargs)
    return path, model, opt


def _item_of(path, fqn):
    """(data file, offset, length) of the stored item of ``fqn`` in a one-process checkpoint."""
    with open(os.path.join(path, store.METADATA), "rb") as f:
        metadata = read_metadata_safely(f)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    return info.relative_path, info.offset, info.length


def test_a_flipped_byte_in_a_data_file_is_named(tmp_path):
    """The issue's reproduction: one byte of a weight's stored bytes changed (-0.0027 became
    -9.3e35) and the checkpoint loaded without a word."""
    path, model, opt = _saved(tmp_path)
    name, offset, length = _item_of(path, "model.embed.weight")
    with open(os.path.join(path, name), "r+b") as f:
        archive = zipfile.ZipFile(io.BytesIO(f.read()[offset:offset + length]))
        record = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        f.seek(offset + record.header_offset + 30 + len(record.filename) + len(record.extra) + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    damaged = f"data file {name} is damaged: bytes {offset} to {offset + length} have crc32 "
    with pytest.raises(CheckpointError, match=damaged):
        fsdp8.load(path, model, opt)
    assert fsdp8.checkpoint.verify(path) == []  # the quick check reads no data
    problems = fsdp8.checkpoint.verify(path, data=True)
    assert len(problems) == 1 and damaged in problems[0]


def test_a_full_disk_says_so_with_the_file(tmp_path, monkeypatch):
    """It read "[enforce fail at inline_container.cc:672] unexpected pos": torch.save's writer
    drops the OSError. Here the data file is /dev/full, which fails writes with ENOSPC."""
    first, model, opt = _saved(tmp_path, "step-1")
    opened = pathlib.Path.open

    def full_disk(self, mode="r", *args, **kwargs):
        return opened(pathlib.Path("/dev/full") if self.suffix == ".distcp" and "w" in mode else self, mode,
                      *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", full_disk)
    second = str(tmp_path / "step-2")
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint file {re.escape(second)}.partial/__0_0.distcp: "
                                              "No space left on device; free space there or save elsewhere"):
        fsdp8.save(second, model, opt)
    assert fsdp8.checkpoint.latest(str(tmp_path)) == first


@pytest.mark.parametrize("damage,cause", [
    ('{"step": 1, "rng": ', "Expecting value: line 1 column 20"),
    ('{"rng": {"__tensor__": "uint8", "shape": [9], "data": "AAAA"}}',
     r"extra\['rng'\] holds 3 bytes, not the 9 of a torch.uint8 tensor of shape \[9\]"),
])
def test_a_damaged_extra_file_fails_before_any_weight_loads(tmp_path, damage, cause):
    """It raised JSONDecodeError or TypeError (naming no file) after the weights were loaded."""
    path, _, _ = _saved(tmp_path)
    with open(store.extra_path(path, 0), "w") as f:
        f.write(damage)
    model, opt = _model()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"{re.escape(store.extra_path(path, 0))} cannot be read: {cause}"):
        fsdp8.load(path, model, opt)
    assert all(torch.equal(v.full_tensor(), before[k]) for k, v in model.state_dict().items())


def test_keep_last_rotates_only_its_own_series(tmp_path):
    """Saving d/run-step1..3 with keep_last=2 deleted d/other-final."""
    model, opt = _model()
    fsdp8.save(str(tmp_path / "other-final"), model, opt)
    for step in (1, 2, 3):
        fsdp8.save(str(tmp_path / f"run-step{step}"), model, opt, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["other-final", "run-step2", "run-step3"]


def test_checkpoints_are_ordered_by_step_never_by_the_clock(tmp_path, monkeypatch):
    """With the clock set back an hour, rotation deleted the newest step and latest() returned
    an older one."""
    model, opt = _model()
    for step, clock in ((9, 10**18), (10, 10**18 + 1), (11, 10**18 - 3600 * 10**9)):
        monkeypatch.setattr(time, "time_ns", lambda clock=clock: clock)
        fsdp8.save(str(tmp_path / f"step-{step:06d}"), model, opt, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000010", "step-000011"]
    assert fsdp8.checkpoint.latest(str(tmp_path)) == str(tmp_path / "step-000011")
    # Names without a step go by the order they were published in, before any numbered one.
    other = tmp_path / "other"
    for name in ("z-first", "a-second"):
        fsdp8.save(str(other / name), model, opt)
    assert fsdp8.checkpoint.latest(str(other)) == str(other / "a-second")
    fsdp8.save(str(other / "step-000001"), model, opt)
    fsdp8.save(str(other / "later"), model, opt)
    assert fsdp8.checkpoint.latest(str(other)) == str(other / "step-000001")


def test_checksums_computed_while_writing_are_those_of_the_files(tmp_path):
    """The writer crc32s each item as DCP writes it (between two tell()s); read back, every
    item has that checksum, and an item it did not see is read back for its checksum."""
    path, _, _ = _saved(tmp_path)
    with open(os.path.join(path, checksums.FILE)) as f:
        written = json.load(f)
    items = [(name, offset, length) for name, spans in written.items() for offset, length, _ in spans]
    assert len(items) > 10
    for name, spans in written.items():
        with open(os.path.join(path, name), "rb") as f:
            assert [[o, n, checksums.crc32_of(f, o, n)] for o, n, _ in spans] == spans
    checksums.write_rank_file(path, 7, items, known={})
    with open(os.path.join(path, "checksums.rank7.json")) as f:
        assert json.load(f) == written
