"""`fsdp8 train` decides in the launching process, in one line, before any worker starts:
bad flags, an earlier run in --out, --overwrite. All in this process: launch is replaced."""

import io
import json
import os
import re

import pytest

from fsdp8 import cli
from fsdp8.train import Progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def launched(monkeypatch):
    """The configs `fsdp8 train` would have started workers with."""
    calls = []
    monkeypatch.setattr(cli, "launch", lambda fn, args, nproc=None: calls.append(args[0]) or 0)
    return calls


def _earlier_run(out):
    """What `fsdp8 train --save-every 20 --steps 40 --out OUT` leaves, as far as the checks look."""
    for step in (20, 40):
        ckpt = out / "checkpoints" / f"step-{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "COMPLETE.json").write_text(json.dumps({"sequence": step}))
    (out / "metrics.jsonl").write_text('{"step": 40, "loss": 1.0}\n')
    (out / "notes.txt").write_text("not written by fsdp8")


def _error_line(capsys):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp8 train: error: "), err
    return lines[0]


def test_refuses_to_start_where_an_earlier_run_is(tmp_path, capsys, launched):
    out = tmp_path / "x"
    _earlier_run(out)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--steps", "10", "--save-every", "5", "--out", str(out)])
    assert exit_info.value.code == 2 and launched == []
    line = _error_line(capsys)
    assert "holds an earlier run (checkpoints/ up to step-000040, metrics.jsonl)" in line
    assert "--resume" in line and "--overwrite" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000020", "step-000040"]


def test_overwrite_deletes_the_earlier_run_and_says_so(tmp_path, capsys, launched):
    out = tmp_path / "x"
    _earlier_run(out)
    assert cli.main(["train", "--steps", "10", "--overwrite", "--out", str(out)]) == 0
    assert len(launched) == 1 and launched[0].overwrite
    assert sorted(os.listdir(out)) == ["notes.txt"]  # only what the earlier run wrote is gone
    assert capsys.readouterr().err.strip().splitlines() == [
        f"--overwrite: deleted the earlier run in {out} (checkpoints/ up to step-000040, metrics.jsonl)"]


@pytest.mark.parametrize("args,message", [
    (["--resume"], "--resume: run: no complete checkpoint in it"),
    (["--resume", "elsewhere"], "--resume: elsewhere: no such directory"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--seq-len", "100000"], "--seq-len 100000 exceeds the 'tiny' preset's 256 positions"),
    (["--out", "a-file"], "--out a-file is a file"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--nproc", "-2"], "--nproc must be >= 1, got -2"),
    (["--resume", "--overwrite"], "pass one of them"),
])
def test_bad_arguments_are_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, launched, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--out", "run", *args] if "--out" not in args else ["train", *args])
    assert exit_info.value.code == 2 and launched == []
    assert message in _error_line(capsys)


def _train_help(capsys) -> dict:
    """`fsdp8 train -h` as {flag: its help text}."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "-h"])
    assert exit_info.value.code == 0
    options = capsys.readouterr().out.split("options:")[1]
    blocks = re.split(r"\n  (?=-)", "\n" + options)[1:]
    return {re.match(r"(?:-h, )?(--[\w-]+)", b).group(1): " ".join(b.split()) for b in blocks}


def test_help_shows_every_flag_with_its_default_and_version(capsys):
    flags = _train_help(capsys)
    assert len(flags) > 15 and "--resume" in flags
    assert [f for f, text in flags.items() if f != "--help" and "(default: " not in text] == []
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and re.match(r"fsdp8 \d+\.\d+\.\d+ ", capsys.readouterr().out)


class _Terminal(io.StringIO):
    def isatty(self):
        return True

    def screen(self) -> list:
        """The lines a terminal shows: a carriage return moves back and overwrites."""
        lines = []
        for row in self.getvalue().split("\n"):
            shown = ""
            for part in row.split("\r"):
                shown = part + shown[len(part):]
            lines.append(shown)
        return lines


def test_progress_bar_clears_what_a_shorter_line_leaves():
    term = _Terminal()
    bar = Progress(100, stream=term)
    bar.update(10, "loss 5.000 | mem 1425 MiB")
    bar.update(20, "loss 4.000 | mem 425 MiB")
    assert term.screen()[-1].rstrip() == "step  20/100 [######........................] loss 4.000 | mem 425 MiB"
    bar.note("saved checkpoint c")
    bar.update(30, "loss 3.0")
    bar.close()
    assert [line.rstrip() for line in term.screen()] == [
        "saved checkpoint c", "step  30/100 [#########.....................] loss 3.0", ""]


def test_readme_lists_every_train_flag_and_links_the_design_doc(capsys):
    readme = open(os.path.join(REPO, "README.md")).read()
    assert [f for f in _train_help(capsys) if f != "--help" and f not in readme] == []
    assert "](docs/DESIGN.md)" in readme and os.path.isfile(os.path.join(REPO, "docs", "DESIGN.md"))
    links = re.findall(r"\]\(((?!https?:)[^)#]+)", readme)
    assert [link for link in links if not os.path.exists(os.path.join(REPO, link))] == []
