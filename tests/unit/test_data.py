"""Unit tests for the byte corpus: packaging, determinism, world-size independence, errors."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fsdp8.data import (VAL_FRACTION, ByteCorpus, check_text_file, decode, encode, has_tokenizer, load_corpus,
                        load_tokenizer)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def train():
    return ByteCorpus(split="train")


def test_packaged_corpus_is_ascii_text():
    data = load_corpus()
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert 250_000 < data.numel() < 350_000
    assert int(data.max()) < 128
    assert "plus" in decode(data[:20_000])


def test_committed_corpus_matches_generator():
    spec = importlib.util.spec_from_file_location("make_corpus", REPO / "tools" / "make_corpus.py")
    make_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_corpus)
    text = make_corpus.generate(make_corpus.DEFAULT_SEED, make_corpus.DEFAULT_BYTES)
    assert text.encode("ascii") == bytes(load_corpus().tolist())


def test_batches_are_deterministic(train):
    a = train.batch(step=5, rank=0, world_size=1, batch_per_rank=4, seq_len=32)
    b = train.batch(step=5, rank=0, world_size=1, batch_per_rank=4, seq_len=32)
    c = train.batch(step=6, rank=0, world_size=1, batch_per_rank=4, seq_len=32)
    d = train.batch(step=5, rank=0, world_size=1, batch_per_rank=4, seq_len=32, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])


def test_global_batch_does_not_depend_on_world_size(train):
    whole_inputs, whole_targets = train.batch(step=3, rank=0, world_size=1, batch_per_rank=8, seq_len=16)
    parts = [train.batch(step=3, rank=r, world_size=2, batch_per_rank=4, seq_len=16) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole_inputs)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_targets)


def test_targets_are_inputs_shifted_by_one(train):
    inputs, targets = train.batch(step=0, rank=1, world_size=3, batch_per_rank=5, seq_len=24)
    assert inputs.shape == targets.shape == (5, 24)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    text = decode(train.data)
    for row_in, row_tg in zip(inputs, targets):
        window = decode(torch.cat([row_in, row_tg[-1:]]))
        assert window in text


def test_val_split_is_the_tail():
    data = load_corpus()
    train, val = ByteCorpus(split="train"), ByteCorpus(split="val")
    assert len(train) + len(val) == data.numel()
    assert len(val) == int(data.numel() * VAL_FRACTION)
    assert torch.equal(val.data, data[len(train):])
    inputs, _ = val.batch(step=0, rank=0, world_size=1, batch_per_rank=2, seq_len=8)
    assert decode(inputs[0]) in decode(val.data)


def test_encode_decode_round_trip():
    tokens = encode("plus = 7, café")
    assert tokens.dtype == torch.int64 and int(tokens.max()) < 256
    assert decode(tokens) == "plus = 7, café"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=2, world_size=2), "rank must be in"),
        (dict(rank=0, world_size=0), "world_size"),
        (dict(batch_per_rank=0), "batch_per_rank"),
        (dict(seq_len=10), "shorter seq_len"),
        (dict(step=-1), "step"),
    ],
)
def test_batch_errors(kwargs, message):
    corpus = ByteCorpus(torch.arange(200, dtype=torch.uint8), split="val")  # 10 bytes
    args = dict(step=0, rank=0, world_size=1, batch_per_rank=1, seq_len=4) | kwargs
    with pytest.raises(ValueError, match=message):
        corpus.batch(**args)


def test_constructor_errors():
    with pytest.raises(ValueError, match="split"):
        ByteCorpus(split="test")
    with pytest.raises(ValueError, match="uint8"):
        ByteCorpus(torch.arange(100))


def test_a_directory_or_a_binary_file_is_no_data(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + bytes(64))
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    # A 3-byte character cut by the 64 KiB look is no error: the text goes on past it.
    (tmp_path / "long.txt").write_bytes("€".encode() * 30000)
    check_text_file(str(tmp_path / "long.txt"))
    for name, message in [(".", " is a directory; give one text file to train on"),
                          ("weights.safetensors", " is not text: it has a NUL byte at offset 1"),
                          ("latin1.txt", " is not UTF-8 text (byte 0xe9 at offset 3 is invalid)"),
                          ("missing.txt", ": no such file")]:
        path = str(tmp_path / name)
        with pytest.raises(ValueError) as e:
            check_text_file(path)
        assert str(e.value).startswith(f"--data {path}{message}"), e.value


def test_a_tokenizer_model_alone_is_a_tokenizer(tmp_path):
    """A directory whose tokenizer is only SentencePiece's tokenizer.model (Llama 2, Mistral v0.1):
    transformers reads it through sentencepiece, which the [hf] extra brings."""
    import sentencepiece

    text = decode(load_corpus()).splitlines()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(tmp_path / "tokenizer"),
                                             vocab_size=300, model_type="bpe", minloglevel=2)
    (tmp_path / "tokenizer.vocab").unlink()
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert has_tokenizer(str(tmp_path))
    tokenizer = load_tokenizer(str(tmp_path))
    assert len(tokenizer) == 300 and tokenizer.decode(tokenizer.encode("plus = 7", add_special_tokens=False)) == "plus = 7"


def test_load_tokenizer_without_transformers_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ImportError, match=r'^a Hugging Face tokenizer needs transformers \(.*\); install fsdp8\'s '
                                          r'Hugging Face extra: pip install -e "\.\[hf\]"$'):
        load_tokenizer(str(tmp_path))
