"""Hugging Face models under fully_shard: GPT-2 in FP8, meta-device init, load_pretrained.

The FP8 parity bound is test_fp8_engine.py's (1e-5, lockstep from equal weights): the engine
and the single-process reference quantize the same bf16 values with the same scales, so
only the fp32 order of the gradient sum differs."""

import pytest
import torch

from tests.harness import run_on_ranks

pytest.importorskip("transformers")

from tests.dist import hf_workers  # noqa: E402  (needs transformers)

TOL = 1e-5
GPT2_PROJECTIONS = [f"hf.transformer.h.{i}.{p}" for i in range(2)
                    for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def test_gpt2_fp8_converts_conv1d_and_trains_like_one_process():
    for errors, converted, (fp8_loss, bf16_loss) in run_on_ranks(2, hf_workers.gpt2_fp8_parity):
        assert converted == sorted(GPT2_PROJECTIONS)
        assert fp8_loss != bf16_loss  # FP8 GEMMs really ran (they used to be silently skipped)
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, bad


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_meta_init_of_hf_models(kind):
    for out in run_on_ranks(2, hf_workers.meta_init, kind):
        assert out["leftovers"] == []
        # Norm weights, biases, ...: the values a CPU-built model has.
        assert out["constants"] and all(out["constants"].values()), out["constants"]
        # Random tensors: the model's own init scheme (_init_weights: std 0.02, and GPT-2's
        # residual projections std 0.02 / sqrt(2 * n_layer), set by their parent module),
        # not torch's defaults (kaiming for nn.Linear: std ~0.07 here).
        off = {k: r for k, r in out["stds"].items() if not 0.9 < r < 1.1}
        assert not off, off
        assert out["logits_err"] <= 1e-6
        if kind != "gpt2":
            assert out["rotary"] and all(out["rotary"].values()), out["rotary"]


def test_meta_init_does_not_depend_on_world_size():
    one = run_on_ranks(1, hf_workers.meta_init, "gpt2")[0]["state"]
    two = run_on_ranks(2, hf_workers.meta_init, "gpt2")[0]["state"]
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """HF save_pretrained directories (safetensors) of the tiny models."""
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for kind in ("gpt2", "qwen2"):
        paths[kind] = str(root / kind)
        hf_workers.hf_model(kind).save_pretrained(paths[kind])
    return paths


def test_load_pretrained_into_meta_built_sharded_model(saved):
    for state_err, logits_err, whole, _ in run_on_ranks(2, hf_workers.load_pretrained_sharded, "qwen2",
                                                        saved["qwen2"], False):
        assert state_err == 0.0 and logits_err <= 1e-6
        assert whole == []  # every rank read only its rows


def test_load_pretrained_transposes_hf_conv1d_into_fp8_gpt2(saved):
    for state_err, _, whole, transposed in run_on_ranks(2, hf_workers.load_pretrained_sharded, "gpt2",
                                                        saved["gpt2"], True):
        assert len(transposed) == 8
        assert state_err == 0.0
        assert whole == []  # a transposed weight too: its rows are a column block of the file


def test_fp8_gpt2_checkpoint_and_export_round_trip(saved, tmp_path):
    """fsdp8 checkpoints and exports of a converted GPT-2 hold the (out, in) layout."""
    converted, errors = run_on_ranks(2, hf_workers.fp8_gpt2_checkpoint_roundtrip, saved["gpt2"],
                                     str(tmp_path / "ckpt"), str(tmp_path / "export"))[0]
    assert converted == 8 and errors == [0.0, 0.0]


def test_load_pretrained_under_tensor_parallelism(tmp_path):
    """At dp 2 x tp 2 each rank reads only its dp rows of its tp piece (of a dim-1 piece,
    only its columns of those rows), and the weights come out exact."""
    for error, read, needed, whole in run_on_ranks(4, hf_workers.load_pretrained_tensor_parallel,
                                                   str(tmp_path / "w.safetensors")):
        assert error == 0.0
        assert read == needed and read < whole / 2
