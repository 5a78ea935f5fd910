"""`fsdp8 train` decides in the launching process, in one line, before any worker starts:
bad flags, an earlier run in --out, --overwrite; and what a run says as it starts. All in this
process: launch is replaced, or the run is one rank here (--nproc 1)."""

import io
import json
import os
import re
import sys

import pytest
import torch

from fsdp8.app import cli
from fsdp8.app.train import command as train_command
from fsdp8.app.train.run_log import Progress

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def launched(monkeypatch):
    """The configs `fsdp8 train` would have started workers with."""
    calls = []
    monkeypatch.setattr(train_command, "launch", lambda fn, args, **kwargs: calls.append(args[0]) or 0)
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
    assert "holds an earlier run (checkpoints/ up to step-000040, metrics.jsonl to step 40)" in line
    assert "--resume" in line and "--overwrite" in line
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000020", "step-000040"]


def test_overwrite_deletes_the_earlier_run_and_says_so(tmp_path, capsys, launched):
    out = tmp_path / "x"
    _earlier_run(out)
    assert cli.main(["train", "--steps", "10", "--overwrite", "--out", str(out)]) == 0
    assert len(launched) == 1 and launched[0].overwrite
    assert sorted(os.listdir(out)) == [".fsdp8-run.lock", "notes.txt"]  # only what the earlier run wrote is gone
    assert capsys.readouterr().err.strip().splitlines() == [
        f"--overwrite: deleted the earlier run in {out} (checkpoints/ up to step-000040, metrics.jsonl to step 40)"]


@pytest.mark.parametrize("args,message", [
    (["--resume"], "--resume: run holds no checkpoint to continue from (a run writes them with --save-every N or "
                   "--stop-at N); rerun without --resume to start afresh"),
    (["--resume", "elsewhere"], "--resume: elsewhere: no such directory"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--seq-len", "100000"], "--seq-len 100000 exceeds the 'tiny' preset's 256 positions"),
    (["--out", "a-file"], "--out a-file is a file"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--nproc", "-2"], "--nproc must be >= 1, got -2"),
    (["--resume", "--overwrite"], "pass one of them"),
    # Layouts: the world size, the model's shapes and the sequence length against the degrees.
    (["--nproc", "3", "--tp", "2"], "3 worker processes do not divide into groups of --dp-replicate 1 x --cp 1 x "
                                    "--tp 2 = 2; run a multiple of 2 workers (--nproc)"),
    (["--nproc", "8", "--dp-replicate", "2", "--cp", "3", "--seq-len", "120"],
     "--dp-replicate 2 x --cp 3 x --tp 1 = 6"),
    # Every size tp splits, and the tp values that divide them all (not those of one size alone).
    (["--nproc", "3", "--tp", "3"], "--tp 3: tensor_parallel: tp=3 must divide n_heads=4 and n_kv_heads=2 (each rank "
                                    "computes whole heads), and the split dims 128 (layers.*.attn.wq, layers.*.attn.wo) "
                                    "and 64 (layers.*.attn.wk, layers.*.attn.wv); use tp in (1, 2), which divide them "
                                    "all"),
    (["--nproc", "4", "--tp", "4"], "--tp 4: tensor_parallel: tp=4 must divide n_kv_heads=2 (each rank computes "
                                    "whole heads); use tp in (1, 2), which divide them all"),
    (["--nproc", "4", "--cp", "2", "--seq-len", "30"], "--seq-len 30 is not a multiple of 4: --cp 2 cuts each "
                                                       "sequence into 2 x 2 equal chunks; pass --seq-len 28"),
    (["--nproc", "8", "--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "36"],
     "--seq-len 36 is not a multiple of 8"),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "33"], "--seq-len 33 is not a multiple of 2"),
    (["--loss-parallel"], "--loss-parallel needs tensor parallelism: pass --tp N"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--ep", "0"], "--ep must be >= 1, got 0"),
    (["--nproc", "4", "--ep", "3", "--preset", "moe-tiny"], "--ep 3 must divide the 4 data-parallel shard ranks"),
    (["--nproc", "2", "--ep", "2"], "--ep 2: ep=2 splits the experts of a mixture-of-experts model, but Llama has "
                                    "none (its adapter found no experts module); use ep=1 for a dense model; a "
                                    "built-in mixture-of-experts model is --preset moe-tiny"),
    (["--nproc", "2", "--ep", "2", "--tp", "2", "--preset", "moe-tiny"],
     "--ep 2 must divide the 1 data-parallel shard ranks (--nproc / (--dp-replicate x --cp x --tp))"),
    (["--nproc", "4", "--tp", "2", "--preset", "moe-tiny"],
     "--tp 2 with a mixture-of-experts model: tensor parallelism splits attention and dense layers, and the experts "
     "go to expert parallelism; add --ep N"),
    (["--preset", "moe-tiny", "--fp8-dispatch"], "--fp8-dispatch sends tokens to their experts' ranks in FP8, but "
                                                   "without --ep N (N > 1) none are sent; pass --ep too"),
    (["--load-balancing", "global"], "--load-balancing global: load_balancing='global' applies to a "
                                     "mixture-of-experts model's router loss, and this built-in Llama is dense"),
    (["--outer-strategy", "optim"], "--outer-strategy optim shards across HSDP replicas, but there are none"),
    (["--nproc", "4", "--cp", "2", "--ac", "selective"], "--ac selective does not work with --cp 2 yet"),
    (["--offload", "optim", "--strategy", "no_shard"], "--strategy no_shard shards nothing"),
    (["--offload", "optim", "--precision", "fp8-current"],
     "--offload optim does not work with --precision fp8-current"),
    # The model and the data.
    (["--data", "missing.txt"], "--data missing.txt: no such file"),
    (["--data", "run"], "--data run is a directory; give one text file to train on"),
    (["--data", "model.safetensors"], "--data model.safetensors is not text: it has a NUL byte at offset 1"),
    (["--model", "llama"], "--model takes hf:DIR (a Hugging Face model directory) or a built-in preset"),
    (["--model", "small", "--preset", "tiny"], "--model small and --preset tiny name different presets"),
    (["--model", "hf:nowhere"], "--model hf:nowhere: nowhere is not a directory"),
    (["--model", "hf:run"], "--model hf:run: run has no config.json"),
])
def test_bad_arguments_are_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, launched, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--out", "run", *args] if "--out" not in args else ["train", *args])
    assert exit_info.value.code == 2 and launched == []
    assert message in _error_line(capsys)


def test_model_names_a_preset_too(tmp_path, launched):
    assert cli.main(["train", "--model", "small", "--out", str(tmp_path / "run")]) == 0
    assert (launched[0].preset, launched[0].model) == ("small", "")


@pytest.fixture
def hf_dir(tmp_path):
    """A Hugging Face Llama config directory (no weights, no tokenizer) with a vocabulary of 100."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256).save_pretrained(str(tmp_path / "hf"))
    return tmp_path / "hf"


@pytest.mark.parametrize("args,message", [
    ([], "the packaged corpus is read as bytes (256 token ids), but hf:{dir} has a vocabulary of 100; use a model "
         "with vocab_size >= 256, or put a tokenizer in its directory"),
    (["--preset", "small"], "--preset sizes the built-in Llama, which --model hf:{dir} replaces; pass one of them"),
    (["--seq-len", "512"], "--seq-len 512 exceeds the 256 positions of hf:{dir}"),
    (["--nproc", "3", "--tp", "3"], "--tp 3: tensor_parallel: tp=3 must divide num_attention_heads=4 and "
                                    "num_key_value_heads=2 (each rank computes whole heads), and the split dims 64"),
])
def test_bad_hf_model_runs_are_one_line(tmp_path, capsys, launched, hf_dir, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--model", f"hf:{hf_dir}", "--out", str(tmp_path / "run"), *args])
    assert exit_info.value.code == 2 and launched == []
    assert message.format(dir=hf_dir) in _error_line(capsys)


def test_hf_model_without_transformers_names_the_extra(tmp_path, monkeypatch, capsys, launched):
    """`pip install -e .` brings no transformers: --model hf:DIR says how to add it."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", f"hf:{tmp_path / 'hf'}", "--out", str(tmp_path / "run")])
    line = _error_line(capsys)
    assert line == (f"fsdp8 train: error: --model hf:{tmp_path / 'hf'} needs transformers (import of transformers "
                    "halted; None in sys.modules); install fsdp8's Hugging Face extra: pip install -e \".[hf]\""), line


def test_the_extra_the_errors_name_brings_transformers_and_the_tests_install_it():
    tomllib = pytest.importorskip("tomllib")
    from fsdp8.models.hf_dir import INSTALL_HF

    extra = re.search(r"\.\[(\w+)\]", INSTALL_HF).group(1)
    extras = tomllib.loads(open(os.path.join(REPO, "pyproject.toml")).read())["project"]["optional-dependencies"]
    assert any(req.startswith("transformers") for req in extras[extra]), extras
    tested = [req for req in extras["test"] if req.startswith("fsdp8[")]
    assert tested and extra in re.search(r"\[(.*)\]", tested[0]).group(1).split(","), extras["test"]


@pytest.mark.parametrize("text,problem", [
    ('{"model_type": "llama",}', "is not valid JSON: Expecting property name enclosed in double quotes at line 1 "
                                 "column 24; fix it, or give the config.json that save_pretrained writes"),
    ('["llama"]', "holds a JSON array, not an object of config fields"),
])
def test_a_malformed_hf_config_is_named_with_its_problem(tmp_path, capsys, launched, text, problem):
    pytest.importorskip("transformers")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(text)
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", f"hf:{tmp_path / 'hf'}", "--out", str(tmp_path / "run")])
    assert _error_line(capsys).startswith(f"fsdp8 train: error: {tmp_path / 'hf' / 'config.json'} {problem}")


def test_hf_weights_must_be_safetensors(tmp_path, capsys, launched, hf_dir):
    (hf_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", f"hf:{hf_dir}", "--out", str(tmp_path / "run")])
    assert f"the weights in {hf_dir} are not safetensors files" in _error_line(capsys)


def _weights(hf_dir, **changed):
    """Save weights of the fixture's Llama (with ``changed`` config values) into ``hf_dir``."""
    import torch
    import transformers

    config = transformers.LlamaConfig.from_pretrained(str(hf_dir))
    for key, value in changed.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(hf_dir / "weights"))
    os.rename(hf_dir / "weights" / "model.safetensors", hf_dir / "model.safetensors")
    return hf_dir / "model.safetensors"


def _word_tokenizer(hf_dir) -> None:
    """A word-level tokenizer of a few words (a vocabulary within the fixture's 100)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "the", "run", "trains", "on", "text", "."]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(str(hf_dir))


def test_a_corrupt_weight_file_is_one_line_before_anything_starts(tmp_path, capsys, launched, hf_dir):
    """A truncated model.safetensors was a traceback on every rank."""
    _word_tokenizer(hf_dir)  # else its vocabulary of 100 is refused for bytes
    weights = _weights(hf_dir)
    os.truncate(weights, weights.stat().st_size - 1000)
    capsys.readouterr()  # transformers' progress bar
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", f"hf:{hf_dir}", "--out", str(tmp_path / "run")])
    line = _error_line(capsys)
    assert line.startswith(f"fsdp8 train: error: --model hf:{hf_dir}: {weights} is truncated: its ") and launched == []
    assert "an interrupted write or download leaves such a file, so write or fetch it again" in line


def test_weights_of_another_shape_are_one_line_before_anything_starts(tmp_path, capsys, launched, hf_dir):
    _word_tokenizer(hf_dir)
    _weights(hf_dir, intermediate_size=96)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", f"hf:{hf_dir}", "--out", str(tmp_path / "run")])
    line = _error_line(capsys)
    assert line.startswith(f"fsdp8 train: error: --model hf:{hf_dir}: safetensors at {hf_dir} do not match "
                           "LlamaForCausalLM: ") and launched == []
    assert "model.layers.0.mlp.down_proj.weight: file (64, 96) vs model (64, 128)" in line


def test_data_too_short_for_the_tokenizer_is_one_line_before_anything_starts(tmp_path, capsys, launched, hf_dir):
    """With a tokenizer the length in tokens is known only once the file is tokenized: the
    workers failed with a traceback after training, at the first validation."""
    _word_tokenizer(hf_dir)
    data = tmp_path / "text.txt"
    data.write_text("the run trains on text . " * 100)  # 2500 bytes, but 600 tokens: 30 for validation
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", f"hf:{hf_dir}", "--data", str(data), "--seq-len", "32",
                  "--out", str(tmp_path / "run")])
    assert _error_line(capsys) == (
        f"fsdp8 train: error: --data {data} (read with the tokenizer of {hf_dir}) is too short: its validation part "
        "(the last 5%, 30 of 600 tokens) holds no sequence of --seq-len 32 (+1 target); give more text or a shorter "
        "--seq-len")
    assert cli.main(["train", "--model", f"hf:{hf_dir}", "--data", str(data), "--seq-len", "24",
                     "--out", str(tmp_path / "run")]) == 0


def test_workers_check_the_data_length_too(tmp_path, hf_dir):
    """A file too long to tokenize in the launcher is checked where it is tokenized anyway."""
    from fsdp8.app.failures import RunError
    from fsdp8.app.train.config import TrainConfig
    from fsdp8.app.train.io import load_data

    _word_tokenizer(hf_dir)
    data = tmp_path / "text.txt"
    data.write_text("the run trains on text . " * 100)
    with pytest.raises(RunError, match=r"--data .*text.txt \(read with the tokenizer of .*\) is too short: its "
                                       r"validation part \(the last 5%, 30 of 600 tokens\)"):
        load_data(TrainConfig(model=f"hf:{hf_dir}", data=str(data), seq_len=32))
    tokens, recorded, tokenized = load_data(TrainConfig(model=f"hf:{hf_dir}", data=str(data), seq_len=24))
    assert tokens.numel() == 600 and recorded["data"]["bytes"] == 2500 and tokenized


def test_startup_says_where_weights_and_data_come_from_and_what_runs_in_fp8(tmp_path, monkeypatch, capsys, recwarn):
    """One rank in this process (fsdp8 train --nproc 1): the start-up lines, and no library warning
    about the head kept in bf16 (it speaks of fully_shard's units=; the fp8 line says it instead)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # Unset for the run, which sets them, and unset again after it (a plain delenv of an unset
        # name records nothing to put back: later tests would think they run under torchrun).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    text = "a line of text to train on\n" * 100
    (tmp_path / "text.txt").write_text(text)
    threads = torch.get_num_threads()  # the rank sets its own
    try:
        assert cli.main(["train", "--nproc", "1", "--steps", "1", "--precision", "fp8-current", "--seq-len", "32",
                         "--batch-size", "2", "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "run")]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().err.splitlines()
    val = int(len(text) * 0.05)
    assert lines[0].startswith("fsdp8 train: preset tiny (0.85M params), 1 x cpu as dp_shard 1,"), lines
    assert lines[1:4] == ["  weights: freshly initialised (seed 0)",
                          "  fp8: 28 linear layers run FP8 GEMMs; in bf16: head (128x256)",
                          f"  data: --data {tmp_path / 'text.txt'}, read as bytes: {len(text):,} tokens "
                          f"({len(text) - val:,} train, {val:,} validation)"], lines
    assert [str(w.message) for w in recwarn if "units=" in str(w.message)] == []


def test_startup_lines_of_an_hf_directory_without_weights_and_of_a_resumed_run(hf_dir):
    from fsdp8.app.train.config import TrainConfig
    from fsdp8.app.train.startup import startup_lines

    def weights(cfg, resumed_from=None):
        text = startup_lines(cfg, None, params=1, world=1, device="cpu", layout="dp_shard 1", compute="fp32",
                             tokens_per_step=1, tokenized=False, train_tokens=95, val_tokens=5,
                             resumed_from=resumed_from, first_step=40)
        return text.splitlines()[1]

    cfg = TrainConfig(model=f"hf:{hf_dir}", seed=3)
    assert weights(cfg) == f"  weights: freshly initialised (seed 3): {hf_dir} has no *.safetensors files"
    assert weights(cfg, "run/checkpoints/step-000040") == "  weights: resumed at step 40 from run/checkpoints/step-000040"


def test_the_workers_make_no_process_shared_tqdm_lock(monkeypatch):
    """Inductor's compilation opens a disabled tqdm bar; tqdm made a named semaphore for it, which
    a worker's os._exit left registered: "resource_tracker: There appear to be 2 leaked semaphore
    objects" after every fsdp8 train --compile."""
    import multiprocessing.synchronize

    tqdm = pytest.importorskip("tqdm")
    from torch.hub import tqdm as inductors_tqdm

    monkeypatch.delattr(tqdm.tqdm, "_lock", raising=False)  # as in a fresh worker process
    monkeypatch.delattr(tqdm.std.TqdmDefaultWriteLock, "mp_lock", raising=False)
    made = []
    semlock_init = multiprocessing.synchronize.SemLock.__init__
    monkeypatch.setattr(multiprocessing.synchronize.SemLock, "__init__",
                        lambda self, *a, **k: made.append(type(self).__name__) or semlock_init(self, *a, **k))

    def compiles(cfg):
        with inductors_tqdm(total=1, desc="Inductor Compilation", disable=True, delay=0):
            pass

    monkeypatch.setattr(train_command, "train", compiles)
    train_command.train_worker(train_command.TrainConfig())
    assert made == []


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
