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
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

import fsdp8
from fsdp8.checkpoint import CheckpointError, store
from fsdp8.checkpoint import pickle_bounds, safe_io
from fsdp8.checkpoint.pickle_bounds import MetadataBoundError
from fsdp8.checkpoint.safe_io import read_metadata_safely

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
    # Both check the checkpoint first (verify.examine) and raise one CheckpointError with the reason.
    for error in errors:
        assert isinstance(error, CheckpointError) and re.search(expected, str(error)), repr(error)


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


# -- bounds: what allowed objects can still cost (pickle_bounds' [Note: bounds of the metadata unpickler])

def _read_file(tmp_path, data: bytes):
    """What verify.examine says of a checkpoint whose .metadata is ``data`` (the file as load reads it)."""
    from fsdp8.checkpoint.verify import examine

    path = tmp_path / "c"
    path.mkdir()
    (path / store.METADATA).write_bytes(data)
    return examine(str(path)).problems


def test_a_million_deep_tuple_is_an_error_not_a_crash(tmp_path):
    """The issue's 1 MB file: a tuple nested 10^6 deep as a dict key; hashing it overflowed the
    C stack (a segfault of every rank). Read in a child process, so a crash fails only this test."""
    metadata = tmp_path / "deep.pickle"
    metadata.write_bytes(_pickle(pickle.EMPTY_DICT, pickle.NONE, pickle.TUPLE1 * 10**6, pickle.NONE, pickle.SETITEM))
    script = ("import sys\nfrom fsdp8.checkpoint.safe_io import read_metadata_safely\n"
              "from fsdp8.checkpoint.store import CheckpointError\n"
              "try:\n    read_metadata_safely(open(sys.argv[1], 'rb'))\n"
              "except CheckpointError as e:\n    print(type(e).__name__, e)\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script, str(metadata)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=repo))
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-500:]}"
    bound = f"MetadataBoundError checkpoint metadata nests deeper than {pickle_bounds.MAX_DEPTH} levels"
    assert done.stdout.startswith(bound), done.stdout


def test_a_structure_deepened_after_it_was_counted_is_refused():
    """Top-down: put a list into another, then fill it (pickle.dump never does this)."""
    data = _pickle(pickle.EMPTY_LIST, pickle.BINPUT + b"\x00", pickle.TUPLE1,  # ([],)
                   pickle.BINGET + b"\x00", pickle.NONE, pickle.APPEND)
    with pytest.raises(MetadataBoundError, match="changes a list already inside another object with APPEND"):
        read_metadata_safely(io.BytesIO(data))


def test_keys_sharing_one_hash_fail_fast():
    """3,000 MetadataIndex keys whose offsets share one hash: each insert compared with every
    key before it (the issue's 831 KB file took 24 s; this one took 1.5 s, quadratically more
    for larger ones). Refused at the ninth key."""
    data = _pickle(_global(META, "MetadataIndex"), pickle.BINPUT + b"\x00", _global("torch", "Size"),
                   pickle.BINPUT + b"\x01", pickle.EMPTY_DICT, pickle.MARK,
                   *(_metadata_index(a, b) + pickle.NONE for a, b in _colliding_pairs(3000)), pickle.SETITEMS)
    with pytest.raises(MetadataBoundError, match=f"more than {pickle_bounds.MAX_SAME_HASH} dictionary keys with one"):
        read_metadata_safely(io.BytesIO(data))


def test_dict_keys_are_names_or_metadata_indices():
    data = _pickle(pickle.EMPTY_DICT, pickle.BININT1 + b"\x07", pickle.NONE, pickle.SETITEM)
    with pytest.raises(safe_io.UnsafeCheckpointError, match="asks for a int as a dictionary key"):
        read_metadata_safely(io.BytesIO(data))


def test_repeated_references_count_every_item():
    """A list of 2^16 references to one list of 2^16 items: 2^32 items to any walk over it,
    from 200 KB of pickle."""
    inner = pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.MARK + pickle.NONE * 2**16 + pickle.APPENDS
    outer = pickle.EMPTY_LIST + pickle.MARK + (pickle.BINGET + b"\x00") * 2**16 + pickle.APPENDS
    with pytest.raises(MetadataBoundError, match=f"more than {pickle_bounds.MAX_ITEMS} items .through repeated"):
        read_metadata_safely(io.BytesIO(_pickle(inner, pickle.POP, outer)))


def test_oversized_opcodes_say_what_they_claim(tmp_path):
    """A string claiming 2^40 bytes: a buffered file allocated them first (MemoryError, an empty
    message: "cannot be read: ")."""
    problems = _read_file(tmp_path, _pickle(pickle.BINUNICODE8 + struct.pack("<Q", 2**40) + b"abc"))
    assert problems == [f"{tmp_path / 'c' / store.METADATA}: checkpoint metadata needs {2**40} bytes at byte 11, but "
                        "its file ends 4 bytes later: it is truncated or damaged"]


def test_garbage_says_it_is_not_a_pickle(tmp_path):
    problems = _read_file(tmp_path, b"not a pickle")
    assert len(problems) == 1 and "is not a readable pickle (UnpicklingError: invalid opcode 0x6e)" in problems[0]


def test_large_real_metadata_reads_and_the_bounds_hold_a_very_large_model():
    """5,000 chunks read as pickle reads them; per chunk, what they cost against the bounds,
    scaled to the 37M chunks of pickle_bounds' [Note: the sizes of a very large checkpoint's metadata]."""
    tensors, chunks = 10, 500
    metadata = _metadata(tensors, chunks)
    data = pickle.dumps(metadata, protocol=4)
    unpickler = safe_io._MetadataUnpickler(io.BytesIO(data), len(data))
    read = unpickler.load()
    assert read == pickle.loads(data)
    per_chunk = 37e6 / (tensors * chunks)
    assert unpickler._built * per_chunk < pickle_bounds.MAX_ITEMS
    assert unpickler._measure(read)[1] * per_chunk < pickle_bounds.MAX_ITEMS
    assert len(data) * per_chunk * 1.6 < pickle_bounds.MAX_METADATA_BYTES  # fqns of 90 characters, not 30
    assert 37e6 < pickle_bounds.MAX_CONTAINER_LEN


def _metadata(tensors: int, chunks: int):
    """The metadata of ``tensors`` row-sharded [64 x chunks, 4096] tensors, one chunk per rank."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state, storage, planner = {}, {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.attn.wq.weight"
        parts = [dcp_metadata.ChunkStorageMetadata(torch.Size([64 * c, 0]), torch.Size([64, 4096]))
                 for c in range(chunks)]
        for c, part in enumerate(parts):
            storage[dcp_metadata.MetadataIndex(fqn, part.offsets)] = _StorageInfo(f"__{c}_0.distcp", t * 2**20, 2**20)
        state[fqn] = dcp_metadata.TensorStorageMetadata(dcp_metadata.TensorProperties(torch.float32),
                                                         torch.Size([64 * chunks, 4096]), parts)
        planner[fqn] = tuple(fqn.split("."))
    return dcp_metadata.Metadata(state, planner, storage, dcp_metadata.StorageMeta("/ckpt", "id"), "1.0.0")


def _metadata_index(a: int, b: int) -> bytes:
    """A MetadataIndex("w", torch.Size([a, b])) as pickle.dump writes it (class in memo 0, Size in 1)."""
    size = pickle.BINGET + b"\x01" + _long(a) + _long(b) + pickle.TUPLE2 + pickle.TUPLE1 + pickle.REDUCE
    state = pickle.EMPTY_DICT + _str("fqn") + _str("w") + pickle.SETITEM + _str("offset") + size + pickle.SETITEM
    return pickle.BINGET + b"\x00" + pickle.EMPTY_TUPLE + pickle.NEWOBJ + state + pickle.BUILD


def _long(v: int) -> bytes:
    return pickle.LONG1 + b"\x09" + v.to_bytes(9, "little", signed=True)


def _colliding_pairs(n: int) -> list:
    """``n`` pairs of ints whose tuples (and torch.Size) share one hash: CPython's tuple hash
    (xxHash's round: acc = rotl(acc + lane * P2, 31) * P1) solved for the second lane."""
    mask, modulus = 2**64 - 1, 2**61 - 1  # int hashes are the value mod 2^61 - 1
    p1, p2, p5 = 11400714785074694791, 14029467366897019727, 2870177450012600261

    def step(acc, lane):
        acc = (acc + lane * p2) & mask
        return (((acc << 31) | (acc >> 33)) & mask) * p1 & mask

    target = step(step(p5, 0), 0)
    pairs, a = [], 0
    while len(pairs) < n:
        a += 1
        lane = (target - step(p5, a)) * pow(p2, -1, 2**64) & mask
        if lane < modulus:
            pairs.append((a, lane))
    assert len({hash(p) for p in pairs}) == 1
    return pairs
