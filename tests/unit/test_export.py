"""fsdp8.checkpoint.export as transformers reads it: the built-in Llama becomes a
LlamaForCausalLM with the same logits, a Hugging Face model's run gets its config.json and
tokenizer beside the weights, and an existing export is not overwritten unasked."""

import json
import os

import pytest
import torch

import fsdp8
from fsdp8.app import cli
from fsdp8.checkpoint import export
from fsdp8.models.llama import Llama, LlamaConfig, preset

transformers = pytest.importorskip("transformers")

# fp32 on a CPU gives the same logits bit for bit (0.0); other kernels may order sums otherwise.
REL_TOL = 1e-5


def _trained(config: LlamaConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = fsdp8.fully_shard(Llama(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    return model, opt


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _same_logits(model, out: str, vocab: int) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return _rel_err(hf(tokens).logits, model(tokens))


def test_a_train_run_of_the_builtin_llama_exports_as_llama_for_causal_lm(tmp_path):
    """fsdp8 train saves its settings (preset tiny) in extra.rank0.json; export finds them."""
    model, opt = _trained(preset("tiny"))
    fsdp8.save(str(tmp_path / "c"), model, opt, extra={"step": 1, "config": {"model": "", "preset": "tiny"}})
    export(str(tmp_path / "c"), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert _same_logits(model, str(tmp_path / "out"), 256) <= REL_TOL


def test_any_builtin_llama_exports_given_its_config(tmp_path):
    """Grouped kv heads, a tied head and another rotary base, through the library call."""
    config = LlamaConfig(vocab_size=300, dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=160, max_seq_len=64,
                         rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=True)
    model, opt = _trained(config)
    fsdp8.save(str(tmp_path / "c"), model, opt)
    export(str(tmp_path / "c"), str(tmp_path / "out"), llama=config)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["tie_word_embeddings"] and saved["rope_theta"] == 500000.0 and saved["num_key_value_heads"] == 2
    assert _same_logits(model, str(tmp_path / "out"), 300) <= REL_TOL
    with pytest.raises(fsdp8.checkpoint.CheckpointError, match="does not hold the built-in Llama it names .3 layers"):
        export(str(tmp_path / "c"), str(tmp_path / "again"), llama=LlamaConfig(**{**vars(config), "n_layers": 3}))


def test_an_existing_export_is_replaced_only_when_asked(tmp_path):
    model, opt = _trained(preset("tiny"))
    fsdp8.save(str(tmp_path / "c"), model, opt)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer.json").write_text("{}")  # a stale file of an earlier export
    with pytest.raises(FileExistsError, match="already holds files .notes.txt, tokenizer.json.; export into an empty "
                                              "or new directory, or pass overwrite=True"):
        export(str(tmp_path / "c"), str(out))
    export(str(tmp_path / "c"), str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]


def test_a_run_whose_model_directory_is_gone_is_one_line(tmp_path, capsys):
    """Not a damaged checkpoint (no older one is offered): what is missing, and nothing written."""
    model, opt = _trained(preset("tiny"))
    fsdp8.save(str(tmp_path / "c"), model, opt, extra={"config": {"model": f"hf:{tmp_path / 'gone'}"}})
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", str(tmp_path / "c"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    config = tmp_path / "gone" / "config.json"
    assert capsys.readouterr().err == (f"fsdp8 export: error: the run trained --model hf:{tmp_path / 'gone'}, whose "
                                       f"config.json export copies, but {config} cannot be read ([Errno 2] No such "
                                       f"file or directory: '{config}'); restore that directory\n")
    assert not os.listdir(tmp_path / "out")


def test_a_run_of_a_hugging_face_model_gets_its_config_and_tokenizer(tmp_path):
    """--model hf:DIR: the run's config.json (in the exported dtype) and tokenizer beside the
    weights, so from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT) work alone."""
    tokenizers = pytest.importorskip("tokenizers")
    hf_dir = tmp_path / "llama"
    bpe = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(str(hf_dir))
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             dtype="bfloat16").save_pretrained(str(hf_dir))
    torch.manual_seed(0)
    model = fsdp8.fully_shard(transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(hf_dir)), dtype=torch.float32))
    fsdp8.save(str(tmp_path / "c"), model, extra={"config": {"model": f"hf:{hf_dir}", "preset": "tiny"}})
    out = tmp_path / "out"
    export(str(tmp_path / "c"), str(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert transformers.AutoTokenizer.from_pretrained(str(out))("a b")["input_ids"] == [1, 2]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert _rel_err(hf(tokens).logits, model(tokens).logits) <= REL_TOL
