"""`fsdp8 train` laid out by parallelize: tensor, sequence, loss and context parallelism, activation
checkpointing and offload, a checkpoint resumed at another layout, and a Hugging Face model
directory with its own weights and tokenizer.

The layouts train the same global batch as the two-process reference (--batch-size is per
data-parallel rank, and the ranks of a tp or cp group share theirs), so every logged loss,
training and validation, must equal the reference's up to float rounding (fp32 on CPU:
measured within 1e-6 relative): a batch chosen by global rather than data-parallel rank, a
loss counted once per tp rank too many, or a cp micro-batch loss divided by the
micro-batch count would each be off by percents or a factor."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fsdp8.app import cli
from fsdp8.app.train import command as train_command
from tests.cli import train_workers
from tests.harness import run_on_ranks

STEPS = 8
COMMON = ["--steps", str(STEPS), "--seq-len", "32", "--batch-size", "4", "--micro-batches", "2", "--log-every", "1",
          "--eval-every", "4"]


def _train(out, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "fsdp8", "train", "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _train_on_pool(out, *args):
    """A two-rank reference run: `fsdp8 train` as its workers run it, on the test pool's ranks (the
    same losses bit for bit, without a launcher's and two workers' start-up)."""
    run_on_ranks(2, train_workers.train_on_pool, ["--out", str(out), *args], timeout=300)


def _records(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ([(r["step"], r["loss"]) for r in records if "loss" in r],
            [(r["step"], r["val_loss"]) for r in records if "val_loss" in r])


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _same_losses(out, reference):
    losses, val = _records(out)
    ref_losses, ref_val = _records(reference)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)) and [s for s, _ in val] == [4, 8]
    for (step, got), (_, want) in zip(losses + val, ref_losses + ref_val):
        assert got == pytest.approx(want, rel=1e-5), (step, got, want)
    assert losses[-1][1] < losses[0][1] - 0.5  # it learns (5.6 -> 4.6 or so)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def reference(runs):
    """Two data-parallel ranks, nothing else."""
    _train_on_pool(runs / "reference", *COMMON)
    return runs / "reference"


@pytest.fixture(scope="module")
def tp_run(runs):
    """dp 2 x tp 2 with sequence and loss parallelism, interrupted after step 4 (checkpoint)
    and resumed on 2 processes without tensor parallelism."""
    out = runs / "tp"
    first = _train(out, "--nproc", "4", "--tp", "2", "--sequence-parallel", "--loss-parallel", "--save-every", "4",
                   "--stop-at", "4", *COMMON)
    assert "4 x cpu as dp_shard 2 x tp 2" in first
    resumed = _train(out, "--resume", "--nproc", "2", "--tp", "1")
    assert "2 x cpu as dp_shard 2," in resumed and "resumed at step 4" in resumed
    return out


def test_tp_sp_lp_trains_as_data_parallel_and_resumes_at_another_layout(tp_run, reference):
    _same_losses(tp_run, reference)
    summary = _summary(tp_run)
    config = summary["config"]
    # The resume ran without tp, so without its switches; the rest came from the checkpoint.
    assert (config["tp"], config["sequence_parallel"], config["loss_parallel"]) == (1, False, False)
    assert (config["micro_batches"], config["save_every"]) == (2, 4)
    assert summary["tokens_per_step"] == _summary(reference)["tokens_per_step"] == 4 * 32 * 2


def test_a_resume_remembers_the_layout(tp_run, monkeypatch):
    launched = []
    monkeypatch.setattr(train_command, "launch", lambda fn, args, **kwargs: launched.append(args[0]) or 0)
    checkpoint = tp_run / "checkpoints" / "step-000004"
    assert cli.main(["train", "--resume", str(checkpoint), "--out", str(tp_run.parent / "again"), "--nproc", "4"]) == 0
    cfg = launched[0]
    assert (cfg.parallel.tp, cfg.parallel.sequence_parallel, cfg.parallel.loss_parallel, cfg.micro_batches) == \
        (2, True, True, 2)


def test_cp_with_full_checkpointing_and_offload_trains_as_data_parallel(runs, reference):
    """dp 2 x cp 2: each rank's loss is its tokens' sum over the step's divisor, so its two
    micro-batches add up to its share (not halved)."""
    out = runs / "cp"
    stderr = _train(out, "--nproc", "4", "--cp", "2", "--ac", "full", "--offload", "optim", *COMMON)
    assert "4 x cpu as dp_shard 2 x cp 2" in stderr and "offloaded to host" in stderr
    _same_losses(out, reference)
    assert _summary(out)["tokens_per_step"] == 4 * 32 * 2


def _tokenizer(text: str, directory) -> int:
    """A byte-level BPE tokenizer of 300 tokens learnt from ``text``, saved into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(str(directory))
    return bpe.get_vocab_size()


def test_hf_model_directory_with_weights_tokenizer_and_data(tmp_path):
    """A Hugging Face Llama directory (config, safetensors weights, tokenizer) and a text file,
    on tp 2 x cp 2 with sequence parallelism: the first logged loss is the loaded model's loss
    on the first batch of the tokenized text, computed here by transformers alone."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from fsdp8.data import TokenCorpus, load_corpus

    text = bytes(load_corpus()[:40_000].tolist()).decode()
    (tmp_path / "text.txt").write_text(text)
    model_dir = tmp_path / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(model_dir))
    assert _tokenizer(text, model_dir) == 300

    out = tmp_path / "run"
    stderr = _train(out, "--model", f"hf:{model_dir}", "--data", str(tmp_path / "text.txt"), "--nproc", "4", "--tp",
                    "2", "--cp", "2", "--sequence-parallel", "--steps", "6", "--seq-len", "32", "--batch-size", "4",
                    "--lr", "0.02", "--log-every", "1", "--eval-every", "6")
    assert f"hf:{model_dir}" in stderr and "4 x cpu as dp_shard 1 x cp 2 x tp 2" in stderr
    losses, _ = _records(out)

    ids = transformers.AutoTokenizer.from_pretrained(str(model_dir)).encode(text, add_special_tokens=False)
    val = int(len(ids) * 0.05)
    assert f"\n  weights: loaded from {model_dir}: model.safetensors\n" in stderr, stderr
    assert (f"\n  data: --data {tmp_path / 'text.txt'}, tokenized with the tokenizer of hf:{model_dir}: {len(ids):,} "
            f"tokens ({len(ids) - val:,} train, {val:,} validation)\n") in stderr, stderr
    x, _ = TokenCorpus(torch.tensor(ids), split="train").batch(0, 0, 1, 4, 32, seed=0)
    with torch.no_grad():
        expected = float(model(input_ids=x, labels=x).loss)
    assert losses[0][1] == pytest.approx(expected, rel=1e-5)
    assert losses[-1][1] < losses[0][1] - 0.3  # it learns (measured: 5.77 -> 5.18)


def test_moe_preset_with_expert_parallelism_trains_as_data_parallel_and_resumes_without_it(runs):
    """--preset moe-tiny --ep 2 on 2 ranks: each expert on one rank, tokens dispatched with
    all-to-all; interrupted at step 4 and resumed without expert parallelism, every logged
    loss equals the plain data-parallel run's (the checkpoint reshards the experts)."""
    moe = ["--preset", "moe-tiny", *COMMON]
    reference = runs / "moe-reference"
    _train_on_pool(reference, *moe)
    out = runs / "moe-ep"
    first = _train(out, "--nproc", "2", "--ep", "2", "--save-every", "4", "--stop-at", "4", *moe)
    assert "2 x cpu as dp_shard 2 (experts over ep 2 of dp_shard)" in first
    resumed = _train(out, "--resume", "--nproc", "2", "--ep", "1")
    assert "resumed at step 4" in resumed and "experts over ep" not in resumed
    _same_losses(out, reference)
    # Resumed with the router loss over the global batch: the setting is kept by a later resume.
    balanced = _train(out, "--resume", "--steps", str(STEPS + 1), "--save-every", "1", "--load-balancing", "global")
    assert "router loss balanced over the global batch" in balanced, balanced[-2000:]
    again = _train(out, "--resume", "--steps", str(STEPS + 2))
    assert f"resumed at step {STEPS + 1}" in again and "router loss balanced over the global batch" in again, \
        again[-2000:]
