"""fsdp8.checkpoint.safetensors: files written and read through the safetensors package,
block reads, and the errors for missing tensors and broken files."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp8.checkpoint import CheckpointError, safetensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def _sample(dtype, shape=(6, 5)):
    if dtype.is_floating_point:
        return (torch.randn(shape) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape).to(dtype)


def _same(a, b):
    """Bit for bit (FP8 too, which torch.equal does not compare)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def test_round_trip_of_every_dtype_with_metadata(tmp_path):
    tensors = {str(d).replace("torch.", ""): _sample(d) for d in DTYPES}
    tensors.update(scalar=torch.tensor(2.5), empty=torch.empty(0, 3, dtype=torch.bfloat16))
    path = str(tmp_path / "x.safetensors")
    safetensors.write(path, tensors, metadata={"format": "pt"})
    assert os.listdir(tmp_path) == ["x.safetensors"]  # no temp file left behind
    f = safetensors.SafetensorsFile(path)
    assert f.metadata == {"format": "pt"} and sorted(f.names()) == sorted(tensors)
    for name, value in tensors.items():
        assert f.shape(name) == tuple(value.shape)
        assert _same(f.read(name), value), name
    # The files are plain safetensors, both ways.
    assert all(_same(v, tensors[k]) for k, v in load_file(path).items())
    save_file({"w": tensors["bfloat16"]}, str(tmp_path / "theirs.safetensors"))
    assert _same(safetensors.SafetensorsFile(str(tmp_path / "theirs.safetensors")).read("w"), tensors["bfloat16"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_rows_and_column_blocks(tmp_path, dtype):
    full = _sample(dtype, (9, 12))
    cube = _sample(dtype, (4, 6, 8))
    path = str(tmp_path / "x.safetensors")
    safetensors.write(path, {"m": full, "c": cube})
    f = safetensors.SafetensorsFile(path)
    assert _same(f.read("m", [(2, 7)]), full[2:7])
    assert _same(f.read("m", [(2, 7), (4, 10)]), full[2:7, 4:10])
    assert _same(f.read("m", [(0, 9), (3, 5)]), full[:, 3:5])
    assert _same(f.read("c", [(1, 3), (2, 6), (0, 4)]), cube[1:3, 2:6, 0:4])
    assert f.read("m", [(5, 5)]).shape == (0, 12)  # a rank with no rows
    for bad in ([(3, 10)], [(4, 2)], [(0, 9), (0, 13)], [(0, 1)] * 3):
        with pytest.raises(safetensors.SafetensorsError, match=r"m has shape \[9, 12\], which holds no block"):
            f.read("m", bad)


def test_tied_and_non_contiguous_tensors_are_written(tmp_path):
    """safetensors refuses tensors that share memory; write gives each its own bytes."""
    weight = torch.randn(8, 4)
    path = str(tmp_path / "x.safetensors")
    safetensors.write(path, {"embed": weight, "head": weight, "t": weight.t(), "rows": weight[2:5]})
    f = safetensors.SafetensorsFile(path)
    assert torch.equal(f.read("embed"), weight) and torch.equal(f.read("head"), weight)
    assert torch.equal(f.read("t"), weight.t()) and torch.equal(f.read("rows"), weight[2:5])


def test_errors_name_the_file_and_what_is_wrong(tmp_path):
    path = str(tmp_path / "x.safetensors")
    safetensors.write(path, {"a": torch.randn(16, 16)})
    with pytest.raises(safetensors.SafetensorsError, match=r"x.safetensors has no tensor 'b'"):
        safetensors.SafetensorsFile(path).read("b")
    with open(path, "r+b") as raw:
        raw.truncate(os.path.getsize(path) - 8)
    with pytest.raises(safetensors.SafetensorsError, match=r"x.safetensors is truncated: .* write or fetch it again"):
        safetensors.SafetensorsFile(path)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(safetensors.SafetensorsError, match=r"junk.safetensors \(64 bytes\) is not a readable"):
        safetensors.SafetensorsFile(str(tmp_path / "junk.safetensors"))
    with pytest.raises(safetensors.SafetensorsError, match="nope.safetensors does not exist"):
        safetensors.SafetensorsFile(str(tmp_path / "nope.safetensors"))
    with pytest.raises(safetensors.SafetensorsError, match="z: dtype torch.complex128 cannot be stored"):
        safetensors.write(str(tmp_path / "c.safetensors"),
                          {"a": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex128)})
    assert not (tmp_path / "c.safetensors").exists()


def test_directory_with_index(tmp_path):
    """An HF-style sharded directory: model.safetensors.index.json names the shard files."""
    safetensors.write(str(tmp_path / "model-00001-of-00002.safetensors"), {"a.weight": torch.ones(2, 3)})
    safetensors.write(str(tmp_path / "model-00002-of-00002.safetensors"), {"b.weight": torch.zeros(4)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                        "b.weight": "model-00002-of-00002.safetensors"}}))
    files = safetensors.SafetensorsDir(str(tmp_path))
    assert sorted(files.names()) == ["a.weight", "b.weight"] and "a.weight" in files
    assert torch.equal(files.file_of("a.weight").read("a.weight", [(1, 2)]), torch.ones(1, 3))
    with pytest.raises(safetensors.SafetensorsError, match="does not exist"):
        safetensors.SafetensorsDir(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(safetensors.SafetensorsError, match="holds no .safetensors file"):
        safetensors.SafetensorsDir(str(tmp_path / "empty"))


def _index(directory, weight_map) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_shards_outside_the_model_directory_are_refused(tmp_path, where):
    """An index naming ../outside/model.safetensors made load_pretrained and fsdp8 train
    --model hf:DIR train on another model."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "model").mkdir()
    other = tmp_path / "outside" / "model.safetensors"
    safetensors.write(str(other), {"a.weight": torch.ones(2, 3)})
    name = {"dotdot": "../outside/model.safetensors", "absolute": str(other), "symlink": "shard.safetensors"}[where]
    if where == "symlink":
        os.symlink(other, tmp_path / "model" / name)
    _index(tmp_path / "model", {"a.weight": name})
    with pytest.raises(CheckpointError, match="model.safetensors.index.json in .*model names the file .*, which is "
                                              "not inside that directory"):
        safetensors.SafetensorsDir(str(tmp_path / "model"))


def test_a_hub_cache_snapshot_reads_its_blobs(tmp_path):
    """The Hugging Face hub's cache: <repo>/snapshots/<rev>/x is a symlink to <repo>/blobs/<hash>."""
    (tmp_path / "repo" / "blobs").mkdir(parents=True)
    snapshot = tmp_path / "repo" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    safetensors.write(str(tmp_path / "repo" / "blobs" / "f00d"), {"a.weight": torch.ones(2, 3)})
    os.symlink("../../blobs/f00d", snapshot / "model.safetensors")
    assert list(safetensors.SafetensorsDir(str(snapshot)).names()) == ["a.weight"]


@pytest.mark.parametrize("index,cause", [
    ({"metadata": {}}, 'has no "weight_map" object mapping tensor names to shard files'),
    ({"weight_map": {"a.weight": 3}}, 'has no "weight_map" object mapping tensor names to shard files'),
    ([], "cannot be read: it is not a JSON object"),
])
def test_a_malformed_index_names_the_file_and_what_is_missing(tmp_path, index, cause):
    """It raised a bare KeyError: 'weight_map'."""
    safetensors.write(str(tmp_path / "model.safetensors"), {"a.weight": torch.ones(2, 3)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(safetensors.SafetensorsError, match=f"model.safetensors.index.json {cause}; write it again"):
        safetensors.SafetensorsDir(str(tmp_path))
