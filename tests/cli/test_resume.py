"""`fsdp8 train` survives interruption and bad steps: resume exactness, what a resumed run
remembers, exporting a run's latest checkpoint, NaN steps skipped."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fsdp8.app import cli
from fsdp8.checkpoint import store
from fsdp8.checkpoint.exporter import read_full_state
from fsdp8.checkpoint.safe_io import read_metadata_safely

COMMON = ["--log-every", "5", "--eval-every", "5"]


def _train(tmp_path, out, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra or {})
    where = ["--out", str(tmp_path / out)] if out else []
    proc = subprocess.run([sys.executable, "-m", "fsdp8", "train", *where, *COMMON, *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """10 steps straight; and 5 steps, then a resume (new processes) given only the run
    directory and a longer --steps: --save-every and the LR schedule come from the checkpoint."""
    tmp = tmp_path_factory.mktemp("resume")
    straight = _train(tmp, "straight", "--steps", "10", "--save-every", "5")
    _train(tmp, "resumed", "--steps", "10", "--stop-at", "5", "--save-every", "5")
    resumed = _train(tmp, None, "--resume", str(tmp / "resumed"), "--steps", "12")
    return tmp, straight, resumed


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


def _metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def test_resume_is_bit_for_bit(runs):
    tmp, _, _ = runs
    a = dict(_tensors(read_full_state(str(tmp / "straight" / "checkpoints" / "step-000010"))))
    b = dict(_tensors(read_full_state(str(tmp / "resumed" / "checkpoints" / "step-000010"))))
    assert set(a) == set(b) and any(k.startswith("optim.state") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]  # weights and optimizer state, bit for bit
    def losses(run):
        return [(r["step"], r["loss"], r["lr"]) for r in _metrics(run) if "loss" in r and r["step"] <= 10]

    assert losses(tmp / "straight") == losses(tmp / "resumed")  # the LR schedule kept its 10 steps


def test_a_resumed_run_covers_the_whole_run(runs):
    tmp, straight, resumed = runs
    assert sorted(os.listdir(tmp / "resumed" / "checkpoints")) == ["step-000005", "step-000010"]  # --save-every 5
    steps = [r["step"] for r in _metrics(tmp / "resumed") if "loss" in r]
    assert steps == [5, 10, 12]  # the first part's records kept, none twice
    first = json.loads((tmp / "straight" / "summary.json").read_text())
    summary = json.loads((tmp / "resumed" / "summary.json").read_text())
    assert summary["first_loss"] == first["first_loss"] and summary["steps_done"] == 12
    assert summary["resumed_from"].endswith("step-000005") and summary["config"]["save_every"] == 5
    # One line per checkpoint written.
    assert straight.stderr.count("saved checkpoint") == 2 and resumed.stderr.count("saved checkpoint") == 1


def test_resume_with_another_preset_names_the_checkpoints(runs, capsys):
    tmp, _, _ = runs
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--resume", str(tmp / "resumed"), "--preset", "small"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-000010 holds the 'tiny' preset, not 'small'" in err


@pytest.mark.parametrize("given", ["resumed", "resumed/checkpoints"])
def test_export_takes_the_latest_checkpoint_of_a_run(runs, capsys, given):
    tmp, _, _ = runs
    out = tmp / f"export-{given.replace('/', '-')}"
    assert cli.main(["export", str(tmp / given), str(out)]) == 0
    ckpt = tmp / "resumed" / "checkpoints" / "step-000010"
    assert capsys.readouterr().err.strip() == (f"wrote model.safetensors, config.json to {out} from {ckpt}: a "
                                               "transformers model")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def _damaged_copy(tmp, damage):
    """A copy of the resumed run (checkpoints step-000005 and step-000010), its newest damaged."""
    run = tmp / f"damaged-{damage}"
    shutil.copytree(tmp / "resumed", run)
    newest = run / "checkpoints" / "step-000010"
    with open(newest / store.METADATA, "rb") as f:
        metadata = read_metadata_safely(f)
    item = next(v for k, v in metadata.storage_data.items() if k.fqn == "model.embed.weight")
    data = newest / item.relative_path
    if damage == "deleted":
        data.unlink()
    else:
        raw = bytearray(data.read_bytes())
        raw[item.offset + item.length // 2] ^= 0x40  # amid the embedding's values
        data.write_bytes(bytes(raw))
    return run, newest, data.name


@pytest.mark.parametrize("damage,cause", [("deleted", "data file {name} is missing"),
                                          ("flipped", "data file {name} is damaged: bytes")])
def test_export_of_a_damaged_checkpoint_is_one_line_naming_an_intact_one(runs, capsys, damage, cause):
    """It printed 44-47 lines of traceback ending in FileNotFoundError or "PytorchStreamReader
    failed reading zip archive" (or, for a flipped byte, exported it)."""
    tmp, _, _ = runs
    run, newest, name = _damaged_copy(tmp, damage)
    out = tmp / f"export-{damage}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", str(run), str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    older = run / "checkpoints" / "step-000005"
    assert err.count("\n") == 1 and err.startswith(f"fsdp8 export: error: checkpoint {newest} cannot be exported: ")
    assert cause.format(name=name) in err
    assert err.endswith(f"; the older checkpoint {older} is intact: fsdp8 export {older} {out}\n")
    assert cli.main(["export", str(older), str(out), "--overwrite"]) == 0


def test_export_refuses_a_directory_that_holds_files(runs, capsys):
    tmp, _, _ = runs
    out = tmp / "occupied"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", str(tmp / "resumed"), str(out)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"fsdp8 export: error: {out} already holds files (notes.txt); give an empty "
                                       "or new directory, or --overwrite to replace the files an export writes there "
                                       "(model.safetensors, config.json, tokenizer files)\n")
    assert cli.main(["export", str(tmp / "resumed"), str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt"]


def test_nan_in_one_ranks_batch_is_reported_and_skipped(tmp_path):
    proc = _train(tmp_path, "nan", "--steps", "10", env_extra={"FSDP8_FAULT": "nan_loss:3:1"})  # step 4 on rank 1
    assert "step 4: gradient norm is nan" in proc.stderr and "step skipped" in proc.stderr
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["skipped_steps"] == [4]
    assert summary["final_loss"] == summary["final_loss"] and summary["final_loss"] < summary["first_loss"]
