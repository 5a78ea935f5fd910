"""A checkpoint whose metadata an attacker (or a damaged disk) edited: files outside the
directory, sizes, offsets and indices past what is stored, chunks that do not cover their
tensor, dtypes that do not fit. Each is refused by fsdp8.load and export before anything is
read or allocated, with a CheckpointError that names the checkpoint and the cause."""

import io
import os
import pickle
import shutil
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import fsdp8
from fsdp8.checkpoint import CheckpointError, store
from fsdp8.checkpoint.exporter import read_full_model_state
from fsdp8.checkpoint.safe_io import read_metadata_safely
from fsdp8.engine.state_dict import StateDictError

DATA = "__0_0.distcp"  # the one data file of a checkpoint saved by one process


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tests.dist.common import UnevenModel

    torch.manual_seed(0)
    model = fsdp8.fully_shard(UnevenModel(vocab=9))
    path = str(tmp_path_factory.mktemp("ckpt") / "c")
    fsdp8.save(path, model)
    return path, model


def _edited(saved, tmp_path, edit) -> str:
    """A copy of the saved checkpoint whose metadata ``edit(metadata, path)`` changed."""
    path = str(tmp_path / "c")
    shutil.copytree(saved[0], path)
    with open(os.path.join(path, store.METADATA), "rb") as f:
        metadata = read_metadata_safely(f)
    edit(metadata, path)
    with open(os.path.join(path, store.METADATA), "wb") as f:
        pickle.dump(metadata, f)
    return path


def _refused(saved, path, tmp_path) -> list:
    """The messages of fsdp8.load and export of ``path``, which must both refuse it."""
    messages = []
    out = tmp_path / "out"
    for read in (lambda: fsdp8.load(path, saved[1]), lambda: fsdp8.checkpoint.export(path, str(out))):
        with pytest.raises(CheckpointError) as error:
            read()
        messages.append(str(error.value))
    assert not out.exists() or not os.listdir(out)  # nothing written
    return messages


def _tensor(metadata, name="model.embed.weight"):
    return metadata.state_dict_metadata[name]


def _point_items(metadata, name: str) -> None:
    for info in metadata.storage_data.values():
        info.relative_path = name


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_data_files_outside_the_checkpoint_are_refused(saved, tmp_path, where):
    """The issue's reproduction: the metadata (or a symlink in the directory) names another
    checkpoint's data file; load filled the weights from it and export published them."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(os.path.join(saved[0], DATA), outside / "other.distcp")

    def edit(metadata, path):
        if where == "absolute":
            _point_items(metadata, str(outside / "other.distcp"))
        elif where == "dotdot":
            _point_items(metadata, "../outside/other.distcp")
        else:
            os.remove(os.path.join(path, DATA))
            os.symlink(outside / "other.distcp", os.path.join(path, DATA))

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert "which is not inside that directory (symlinks resolved)" in message


def test_a_refusal_says_nothing_about_what_is_outside(saved, tmp_path):
    """It said "/etc/shadow is truncated (631 of 999999 bytes)": whether a file exists, and its size."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 631)
    messages = []
    for i, name in enumerate((str(secret), str(tmp_path / "absent"))):
        path = _edited(saved, tmp_path / str(i), lambda metadata, _: _point_items(metadata, name))
        messages.append(_refused(saved, path, tmp_path / str(i))[0].replace(name, "NAME").replace(f"/{i}/", "/"))
    assert messages[0] == messages[1] and "631" not in messages[0]


def test_a_symlink_to_a_file_inside_is_read(saved, tmp_path):
    def edit(metadata, path):
        os.rename(os.path.join(path, DATA), os.path.join(path, "moved.distcp"))
        os.symlink("moved.distcp", os.path.join(path, DATA))

    path = _edited(saved, tmp_path, edit)
    fsdp8.load(path, saved[1])
    assert set(read_full_model_state(path)) == set(saved[1].state_dict())


def test_a_tensor_larger_than_its_stored_chunks_is_refused(saved, tmp_path):
    """Export allocated the declared size and wrote the part no chunk filled, uninitialised
    process memory, into model.safetensors."""
    def edit(metadata, _):
        entry = _tensor(metadata)
        entry.size = torch.Size([entry.size[0] * 1000, entry.size[1]])

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert "the chunks of tensor model.embed.weight (size [9000, 17]) do not cover each of its elements" in message


def test_a_tensor_with_no_stored_chunk_is_refused(saved, tmp_path):
    """It loaded, leaving the weight at its initial values."""
    for message in _refused(saved, _edited(saved, tmp_path, lambda m, _: setattr(_tensor(m), "chunks", [])), tmp_path):
        assert "the chunks of tensor model.embed.weight (size [9, 17]) do not cover" in message


def test_overlapping_chunks_are_refused(saved, tmp_path):
    """Rows 0-4 and 4-7 of 9: as many elements as the tensor, one row twice and one never."""
    def edit(metadata, _):
        entry = _tensor(metadata)
        first = MetadataIndex("model.embed.weight", torch.Size([0, 0]))
        metadata.storage_data[MetadataIndex("model.embed.weight", torch.Size([4, 0]))] = metadata.storage_data[first]
        entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([5, 17])),
                        ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 17]))]

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert "the chunks of tensor model.embed.weight (size [9, 17]) do not cover each of its elements" in message


def test_a_chunk_outside_its_tensor_is_refused(saved, tmp_path):
    def edit(metadata, _):
        chunk = _tensor(metadata).chunks[0]
        chunk.offsets = torch.Size([10**12, 0])
        metadata.storage_data[MetadataIndex("model.embed.weight", chunk.offsets)] = next(iter(
            metadata.storage_data.values()))

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert f"has a chunk at [{10**12}, 0] of size [9, 17], which reaches outside it" in message


def test_a_stored_item_past_the_end_of_its_file_is_refused(saved, tmp_path):
    def edit(metadata, _):
        next(iter(metadata.storage_data.values())).offset = 10**15

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert f"data file {DATA} is truncated" in message


def test_a_stored_item_smaller_than_its_chunk_is_refused(saved, tmp_path):
    def edit(metadata, _):
        metadata.storage_data[MetadataIndex("model.embed.weight", torch.Size([0, 0]))].length = 100

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert "tensor model.embed.weight's chunk at [0, 0] holds 612 bytes, but its stored item has 100" in message


def test_a_stored_tensor_of_another_dtype_than_declared_is_refused(saved, tmp_path):
    """The metadata says float64; the stored piece is float32 (DCP's reader converted it)."""
    def edit(metadata, _):
        _tensor(metadata).properties.dtype = torch.float64

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert (f"data file {DATA}, the item of model.embed.weight at [0, 0] holds a torch.float32 tensor of shape "
                "[9, 17], but the metadata declares torch.float64 [9, 17]") in message


def test_an_int_checkpoint_tensor_into_a_float_weight_is_refused(saved, tmp_path):
    """A plain DCP checkpoint (no fsdp8 marker, as torch writes) with an int32 weight."""
    state = {k: v.full_tensor().detach().clone() for k, v in saved[1].state_dict().items()}
    state["embed.weight"] = state["embed.weight"].round().to(torch.int32)
    path = str(tmp_path / "plain")
    dcp.save({"model": state}, checkpoint_id=path)
    with pytest.raises(StateDictError, match="embed.weight: checkpoint torch.int32 vs model torch.float32"):
        fsdp8.load(path, saved[1])
    state["embed.weight"] = state["embed.weight"].float()
    dcp.save({"model": state}, checkpoint_id=path + "-float")
    fsdp8.load(path + "-float", saved[1])  # a checkpoint without checksums loads


def test_fields_the_metadata_left_out_are_named(saved, tmp_path):
    """An instance may be built with any subset of its fields; a missing one was an AttributeError."""
    def edit(metadata, _):
        del vars(_tensor(metadata))["chunks"]
        del vars(next(iter(metadata.storage_data.values())))["length"]

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert "tensor model.embed.weight has no list of chunks" in message
        assert f"has file '{DATA}', offset 0 and length None" in message


def test_planner_paths_index_only_what_exists(saved, tmp_path):
    """The issue's export with a planner path at index 10^12 grew memory without bound (here
    10^7, which the old export filled with ten million Nones and then dropped the weight)."""
    def edit(metadata, _):
        metadata.planner_data["model.embed.weight"] = ("model", "embed.weight", 10**7)

    message = _refused(saved, _edited(saved, tmp_path, edit), tmp_path)[1]
    assert "planner path of model.embed.weight is ('model', 'embed.weight', 10000000): not a sequence" in message


def test_transformed_items_are_refused(saved, tmp_path):
    """DCP's stream extensions (zstd): a 66-byte item expanded past 3 GB."""
    def edit(metadata, _):
        for info in metadata.storage_data.values():
            info.transform_descriptors = ["stream.zstd/1", "stream.zstd/1"]

    for message in _refused(saved, _edited(saved, tmp_path, edit), tmp_path):
        assert ("is transformed by DCP stream extensions (['stream.zstd/1', 'stream.zstd/1'], e.g. zstd), whose output "
                "nothing bounds: fsdp8 reads only checkpoints written without them") in message


def _replace_item(saved, tmp_path, archive: bytes) -> str:
    """A copy of the saved checkpoint whose embedding item is ``archive`` (appended to its data
    file), without checksums (as a checkpoint torch wrote: else they would catch it first)."""
    def edit(metadata, path):
        info = metadata.storage_data[MetadataIndex("model.embed.weight", torch.Size([0, 0]))]
        with open(os.path.join(path, DATA), "ab") as f:
            info.offset, info.length = f.tell(), len(archive)
            f.write(archive)
        marker = store.read_marker(path)
        del marker["checksums"]
        store.write_json_atomic(os.path.join(path, store.MARKER), marker)

    return _edited(saved, tmp_path, edit)


def _archive(value, compression=zipfile.ZIP_STORED) -> bytes:
    """torch.save of ``value``, its zip records rewritten with ``compression``."""
    raw = io.BytesIO()
    torch.save(value, raw)
    out = io.BytesIO()
    with zipfile.ZipFile(raw) as source, zipfile.ZipFile(out, "w", compression) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    return out.getvalue()


def test_an_item_that_unpacks_larger_than_its_chunk_is_refused(saved, tmp_path):
    """A deflated record of 4 MB of zeros in 5 KB, where the chunk is 612 bytes: torch.load
    would allocate what the record claims (a thousandfold more than the file holds)."""
    path = _replace_item(saved, tmp_path, _archive(torch.zeros(10**6), zipfile.ZIP_DEFLATED))
    for message in _refused(saved, path, tmp_path):
        assert f"data file {DATA}, the item of model.embed.weight at [0, 0] unpacks to 40" in message
        assert "bytes, more than the 612 it stands for" in message


def test_an_item_torch_load_refuses_is_named(saved, tmp_path):
    """torch.load's own errors (here its weights-only unpickler) as a CheckpointError."""
    path = _replace_item(saved, tmp_path, _archive({"x": torch.nn.Linear(1, 1)}))
    for message in _refused(saved, path, tmp_path):
        assert (f"data file {DATA}, the item of model.embed.weight at [0, 0] cannot be read by torch.load "
                "(UnpicklingError: ") in message
