"""The checkpoint metadata unpickler against hand-made pickles: each way a pickle can look
up, build or call something, through both real read paths (fsdp8.load and export) of a
checkpoint that fsdp8 wrote and an attacker then edited."""

import copyreg
import io
import os
import pickle
import re
import shutil
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

import fsdp8
from fsdp8.checkpoint import CheckpointError, store
from fsdp8.checkpoint.safe_io import UnsafeCheckpointError, read_metadata_safely

FS = "torch.distributed.checkpoint.filesystem"  # imports os, io and (through torch) builtins
META = "torch.distributed.checkpoint.metadata"


def _str(s: str) -> bytes:
    data = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + pickle.STACK_GLOBAL


def _text_global(opcode: bytes, module: str, name: str) -> bytes:  # GLOBAL and INST
    return opcode + f"{module}\n{name}\n".encode()


def _pickle(*parts: bytes) -> bytes:
    """Protocol 4, under which the unpickler resolves dotted names through attributes."""
    return pickle.PROTO + b"\x04" + b"".join(parts) + pickle.STOP


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tests.dist.common import UnevenModel

    torch.manual_seed(0)
    model = fsdp8.fully_shard(UnevenModel(vocab=9))
    path = str(tmp_path_factory.mktemp("ckpt") / "c")
    fsdp8.save(path, model)
    return path, model


def _read_both_ways(saved, tmp_path, metadata: bytes) -> list:
    """What fsdp8.load and export raise on the saved checkpoint with ``metadata`` in it."""
    source, model = saved
    path = str(tmp_path / "c")
    shutil.copytree(source, path)
    with open(os.path.join(path, store.METADATA), "wb") as f:
        f.write(metadata)
    errors = []
    for read in (lambda: fsdp8.load(path, model), lambda: fsdp8.checkpoint.export(path, str(tmp_path / "out"))):
        try:
            read()
            errors.append(None)
        except Exception as e:
            errors.append(e)
    return errors


def _assert_refused(errors: list, refused: str) -> None:
    expected = (f"asks for {re.escape(refused)}, which fsdp8 refuses to unpickle: the checkpoint may be malicious, "
                "or written by a torch version")
    load_error, export_error = errors
    # fsdp8.load agrees on the failure over all ranks first, so it raises CheckpointError
    # with the reason; export reads in this process alone and raises the reason itself.
    assert isinstance(load_error, CheckpointError) and re.search(expected, str(load_error)), repr(load_error)
    assert isinstance(export_error, UnsafeCheckpointError), repr(export_error)
    assert re.search(expected, str(export_error)), repr(export_error)


class _RunsShell:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _report(pwned, tmp_path):  # issue 18: a checkpoint module's `os`, found by a dotted name
    return _pickle(_global(FS, "os.system"), _str(f"touch {pwned}"), pickle.TUPLE1, pickle.REDUCE), f"{FS}.os.system"


def _text_global_dotted(pwned, tmp_path):
    call = _str(str(pwned)) + _str("w") + pickle.TUPLE2 + pickle.REDUCE
    return _pickle(_text_global(pickle.GLOBAL, FS, "io.open"), call), f"{FS}.io.open"


def _inst_dotted(pwned, tmp_path):  # INST looks up and calls in one opcode
    inst = _text_global(pickle.INST, FS, "os.system")
    return _pickle(pickle.MARK, _str(f"touch {pwned}"), inst), "pickle opcode INST"


def _obj_eval(pwned, tmp_path):  # OBJ calls the first item after its MARK
    return (_pickle(pickle.MARK, _global(FS, "torch.builtins.eval"), _str(f"open({str(pwned)!r}, 'w')"), pickle.OBJ),
            f"{FS}.torch.builtins.eval")


def _getattr_exec(pwned, tmp_path):  # getattr(builtins, "exec")(source)
    get_exec = _global(FS, "torch.builtins.getattr") + _global(FS, "torch.builtins") + _str("exec") + pickle.TUPLE2
    return (_pickle(get_exec, pickle.REDUCE, _str(f"open({str(pwned)!r}, 'w')"), pickle.TUPLE1, pickle.REDUCE),
            f"{FS}.torch.builtins.getattr")


def _undotted_chain(pwned, tmp_path):  # a plain DCP function that torch.load()s any file with weights_only=False
    evil = tmp_path / "evil.pt"
    torch.save({"state": _RunsShell(f"touch {pwned}")}, evil)
    function = "torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"
    args = _str(str(evil)) + _str(str(tmp_path / "converted")) + pickle.TUPLE2
    return _pickle(_global(*function), args, pickle.REDUCE), ".".join(function)


@pytest.mark.parametrize("attack", [_report, _text_global_dotted, _inst_dotted, _obj_eval, _getattr_exec,
                                    _undotted_chain])
def test_no_global_outside_the_allow_list_runs(saved, tmp_path, attack):
    pwned = tmp_path / "pwned"
    metadata, refused = attack(pwned, tmp_path)
    errors = _read_both_ways(saved, tmp_path, metadata)
    assert not pwned.exists()
    _assert_refused(errors, refused)


@pytest.mark.parametrize("name,layout,code", [("EXT1", "<B", 0xF1), ("EXT2", "<H", 0xF1F1), ("EXT4", "<i", 0xF1F1F1)])
def test_extension_codes_are_refused(saved, tmp_path, name, layout, code):
    """copyreg's extension registry: once any unpickling in the process has resolved a code,
    the code is cached, and EXT1/2/4 then push that object without asking find_class."""
    encoded = getattr(pickle, name) + struct.pack(layout, code)
    pwned = tmp_path / "pwned"
    copyreg.add_extension("os", "system", code)
    try:
        assert pickle.loads(pickle.PROTO + b"\x02" + encoded + pickle.STOP) is os.system  # now cached
        metadata = _pickle(encoded, _str(f"touch {pwned}"), pickle.TUPLE1, pickle.REDUCE)
        errors = _read_both_ways(saved, tmp_path, metadata)
    finally:
        copyreg.remove_extension("os", "system", code)
    assert not pwned.exists()
    _assert_refused(errors, f"pickle opcode {name}")


def _layout_cache():
    """BUILD on torch's own layout-unpickling function: its lookup cache, for the whole process."""
    lookup = _global("torch.serialization", "_get_layout")
    sparse = lookup + _str("torch.sparse_coo") + pickle.TUPLE1 + pickle.REDUCE
    cache = pickle.EMPTY_DICT + _str("torch.strided") + sparse + pickle.SETITEM
    slots = pickle.EMPTY_DICT + _str("cache") + cache + pickle.SETITEM
    return _pickle(lookup, pickle.NONE, slots, pickle.TUPLE2, pickle.BUILD), "state set on a builtin_function_or_method"


def _metadata_class():
    """BUILD on a metadata class itself sets a class attribute for the whole process."""
    slots = pickle.EMPTY_DICT + _str("planner_data") + _str("poisoned") + pickle.SETITEM
    metadata = _pickle(_global(META, "Metadata"), pickle.NONE, slots, pickle.TUPLE2, pickle.BUILD)
    return metadata, "state set on the class Metadata"


def _metadata_instance():
    """BUILD's slot state is setattr(): here it turns the Metadata into another class."""
    slots = pickle.EMPTY_DICT + _str("__class__") + _global(META, "StorageMeta") + pickle.SETITEM
    state = pickle.EMPTY_DICT + _str("state_dict_metadata") + pickle.EMPTY_DICT + pickle.SETITEM
    metadata = _global(META, "Metadata") + pickle.EMPTY_TUPLE + pickle.NEWOBJ
    return _pickle(metadata, state, slots, pickle.TUPLE2, pickle.BUILD), "a tuple as the state of a Metadata"


@pytest.mark.parametrize("attack", [_layout_cache, _metadata_class, _metadata_instance])
def test_build_only_fills_fields_of_metadata_instances(saved, tmp_path, attack):
    metadata, refused = attack()
    try:
        errors = _read_both_ways(saved, tmp_path, metadata)
        poisoned = [torch.serialization._get_layout("torch.strided") is not torch.strided,
                    "planner_data" in vars(dcp_metadata.Metadata) and dcp_metadata.Metadata.planner_data == "poisoned"]
    finally:  # on a failure, leave the process as it was for the tests that follow
        torch.serialization._get_layout.cache = {}
        if vars(dcp_metadata.Metadata).get("planner_data") == "poisoned":
            dcp_metadata.Metadata.planner_data = None
    assert poisoned == [False, False]
    _assert_refused(errors, refused)


@pytest.mark.parametrize("metadata,refused", [
    (_pickle(pickle.PERSID + b"pid\n"), "pickle opcode PERSID"),
    (_pickle(_str("pid"), pickle.BINPERSID), "pickle opcode BINPERSID"),
    (_pickle(pickle.MARK, pickle.MARK, pickle.TUPLE, _text_global(pickle.INST, "torch", "Size")), "pickle opcode INST"),
    (_pickle(pickle.MARK, _global("torch", "Size"), pickle.OBJ), "pickle opcode OBJ"),
    (_pickle(_global(META, "Metadata"), pickle.EMPTY_TUPLE, pickle.EMPTY_DICT, pickle.NEWOBJ_EX),
     "pickle opcode NEWOBJ_EX"),
    (_pickle(_global("copyreg", "_reconstructor"), _global(META, "Metadata"), _global(META, "Metadata"),
             pickle.EMPTY_DICT, pickle.TUPLE3, pickle.REDUCE), "copyreg._reconstructor"),
    (_pickle(_global("torch", "float32"), pickle.EMPTY_TUPLE, pickle.REDUCE), "a call of a dtype"),
    (_pickle(_global("torch.serialization", "_get_layout"), _str("torch.strided"), pickle.TUPLE1, pickle.NEWOBJ),
     "NEWOBJ of a builtin_function_or_method"),
], ids=["PERSID", "BINPERSID", "INST", "OBJ", "NEWOBJ_EX", "_reconstructor", "REDUCE", "NEWOBJ"])
def test_what_dcp_metadata_never_uses_is_refused(saved, tmp_path, metadata, refused):
    """Opcodes and calls that DCP's metadata never needs, on globals the old prefix
    allow-list let through."""
    _assert_refused(_read_both_ways(saved, tmp_path, metadata), refused)


def test_real_metadata_reads_as_pickle_reads_it(saved, tmp_path):
    with open(os.path.join(saved[0], store.METADATA), "rb") as f:
        fsdp8_written = f.read()
    state = {"w": torch.randn(3, 4), "h": torch.ones(2, dtype=torch.bfloat16), "extra": {"step": 3, "name": "x"}}
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"))
    with open(tmp_path / "plain" / store.METADATA, "rb") as f:
        plain = f.read()
    # protocol 3 writes globals as text lines: also a path as Python 3.13 pickles it
    old_protocol = pickle.dumps(read_metadata_safely(io.BytesIO(plain)), protocol=3)
    from_py313 = old_protocol.replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
    assert from_py313 != old_protocol
    for data, reference in ((fsdp8_written, fsdp8_written), (plain, plain), (old_protocol, plain), (from_py313, plain)):
        metadata = read_metadata_safely(io.BytesIO(data))
        assert metadata == pickle.loads(reference) and metadata.state_dict_metadata
