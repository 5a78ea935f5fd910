"""Hugging Face models in one process: GPT-2's Conv1D in FP8, the warnings when FP8 leaves
layers out, and load_pretrained from HF save_pretrained directories (safetensors)."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from transformers.pytorch_utils import Conv1D  # noqa: E402

import fsdp8  # noqa: E402
from fsdp8 import Float8CurrentScaling, convert_to_fp8, load_pretrained  # noqa: E402
from fsdp8.checkpoint import safetensors  # noqa: E402
from fsdp8.engine.state_dict import StateDictError  # noqa: E402
from fsdp8.fp8.convert import Float8Conv1D, convert_units_to_fp8  # noqa: E402
from fsdp8.fp8.linear import Float8Linear  # noqa: E402
from tests.dist.hf_workers import hf_model  # noqa: E402


def _caught(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, [str(w.message) for w in caught if "fsdp8" in str(w.message)]


def _fp8_names(model: nn.Module) -> list:
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def _equal_states(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- Conv1D in FP8 ---------------------------------------------------------------------------------
def test_gpt2_conv1d_becomes_a_float8_linear_of_the_transposed_weight():
    model = hf_model("gpt2")
    original = copy.deepcopy(model)
    converted, messages = _caught(convert_to_fp8, model, Float8CurrentScaling())
    projections = [f"transformer.h.{i}.{p}" for i in range(2)
                   for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert converted is model and _fp8_names(model) == projections + ["lm_head"] and messages == []
    conv = model.transformer.h[0].mlp.c_fc
    source = original.transformer.h[0].mlp.c_fc
    assert isinstance(conv, Float8Conv1D) and (conv.in_features, conv.out_features) == (64, 256)
    assert torch.equal(conv.weight, source.weight.t())
    # The same FP8 GEMMs as a Float8Linear holding W.T: identical output and gradients.
    linear = nn.Linear(64, 256)
    with torch.no_grad():
        linear.weight.copy_(source.weight.t())
        linear.bias.copy_(source.bias)
    convert_to_fp8(linear, Float8CurrentScaling())
    x = torch.randn(2, 8, 64)
    dy = torch.randn(2, 8, 256)
    conv(x).backward(dy)
    out = linear(x)
    out.backward(dy)
    assert torch.equal(conv(x), out)
    assert torch.equal(conv.weight.grad, linear.weight.grad) and torch.equal(conv.bias.grad, linear.bias.grad)


class Router(nn.Module):
    """A projection fsdp8 does not know: a 2-D weight used through F.linear."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 32))

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


def test_warning_names_every_projection_left_in_high_precision():
    model = nn.Sequential(nn.Linear(32, 64), Conv1D(10, 32), Router(), nn.Embedding(8, 32), nn.LayerNorm(32))
    _, messages = _caught(convert_to_fp8, model, Float8CurrentScaling())
    assert _fp8_names(model) == ["0"] and len(messages) == 1
    assert "kept 1 linear layer(s) in high precision, dimensions not multiples of 16" in messages[0]
    assert "1 (32x10)" in messages[0]  # Conv1D(nf=10, nx=32): 32 in, 10 out
    assert "kept 1 layer(s) with a 2-D weight" in messages[0] and "2 (Router)" in messages[0]
    assert "3 (" not in messages[0] and "4 (" not in messages[0]  # embeddings and norms are no projections


class NoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.blocks = nn.ModuleList([nn.LayerNorm(32) for _ in range(2)])


def test_no_layer_in_fp8_is_said_with_the_model_class():
    converted, messages = _caught(convert_to_fp8, NoLinears(), Float8CurrentScaling())
    assert _fp8_names(converted) == [] and len(messages) == 1
    assert "no layer of NoLinears runs in FP8" in messages[0]
    _, messages = _caught(convert_to_fp8, nn.Sequential(nn.Linear(32, 64)), Float8CurrentScaling(),
                          filter=lambda name, module: False)
    assert len(messages) == 1 and "no layer of Sequential runs in FP8" in messages[0]


def test_fully_shard_conversion_names_layers_outside_the_units():
    """convert_units_to_fp8 is what fully_shard(fp8=...) converts with: inside the units only."""
    model = hf_model("gpt2")
    units = [(f"transformer.h.{i}", block) for i, block in enumerate(model.transformer.h)]
    converted, messages = _caught(convert_units_to_fp8, model, units, Float8CurrentScaling())
    assert len(converted) == 8 and len(messages) == 1
    assert "outside the units" in messages[0] and "lm_head (64x256)" in messages[0]
    root = NoLinears()
    root.head = nn.Linear(32, 16)
    _, messages = _caught(convert_units_to_fp8, root, list(root.blocks.named_children()), Float8CurrentScaling())
    assert len(messages) == 2 and "head (32x16)" in messages[0]
    assert "no layer of NoLinears runs in FP8" in messages[1]


def test_kept_layer_warnings_have_a_category_of_their_own():
    """Library callers see which layers stay in high precision and how to convert them; a caller
    for whom that is expected (fsdp8 train, whose start-up line says it) filters the category,
    and still hears when nothing runs in FP8 at all."""
    from fsdp8.fp8.convert import HighPrecisionLayerWarning

    def root(block: nn.Module):
        model = NoLinears()
        model.blocks = nn.ModuleList([block])
        model.head = nn.Linear(32, 16)
        return model, list(model.blocks.named_children())

    with pytest.warns(HighPrecisionLayerWarning, match=r"select such a layer as a unit through units=.*: head \(32x16\)"):
        convert_units_to_fp8(*root(nn.Linear(32, 32)), Float8CurrentScaling())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", HighPrecisionLayerWarning)
        convert_units_to_fp8(*root(nn.LayerNorm(32)), Float8CurrentScaling())
    assert [str(w.message)[:40] for w in caught] == ["fsdp8: FP8 was requested but no layer of"]


# -- meta-device init (tests/dist/test_hf.py builds GPT-2, Llama and Qwen2 on meta) -----------------
def _rope(config, device):
    return 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float, device=device) / 8)), 1.0


class LegacyRotary(nn.Module):
    """A rotary module as transformers 4.4x-4.5x writes them: ``rope_init_fn(config, device)``,
    ``original_inv_freq`` an attribute, and no rule in ``_init_weights`` that fills it."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_init_fn = _rope
        self.register_buffer("inv_freq", self.rope_init_fn(config, None)[0], persistent=False)
        self.original_inv_freq = self.inv_freq


class Gain(nn.Module):
    """Neither reset_parameters() nor a rule in HF's _init_weights."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


class Masked(nn.Module):
    """A constant made in __init__ (GPT-2's causal mask in transformers 4.x)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool), persistent=False)


class TinyConfig(transformers.PretrainedConfig):
    model_type = "fsdp8-tiny"


class Tiny(transformers.PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config, extra=None):
        super().__init__(config)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.rotary = LegacyRotary(config)
        if extra is not None:
            self.extra = extra()
        self.post_init()


def test_meta_init_recomputes_legacy_rotary_tables():
    with torch.device("meta"):
        model = Tiny(TinyConfig())
    model = fsdp8.fully_shard(model)
    assert torch.equal(model.rotary.inv_freq, _rope(None, None)[0])
    assert model.rotary.original_inv_freq is model.rotary.inv_freq


@pytest.mark.parametrize("extra,fix", [(Gain, "give Gain a reset_parameters()"),
                                       (Masked, "build the model with its buffers on a real device")])
def test_meta_init_names_what_nothing_fills(extra, fix):
    with torch.device("meta"):
        model = Tiny(TinyConfig(), extra)
    with pytest.raises(ValueError, match="left unset by meta-device init: neither") as error:
        fsdp8.fully_shard(model)
    assert str(error.value).startswith("extra.gain" if extra is Gain else "extra.mask") and fix in str(error.value)


# -- load_pretrained -------------------------------------------------------------------------------
def _save(model: nn.Module, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def _renamed(src: str, dst, rename) -> str:
    """A copy of ``src``'s weights with every name passed through ``rename``."""
    files = safetensors.SafetensorsDir(src)
    dst.mkdir()
    out = str(dst / "model.safetensors")
    safetensors.write(out, {rename(n): files.file_of(n).read(n) for n in files.names()})
    return out


def test_gpt_neox_head_loads_from_embed_out(tmp_path):
    path = _save(hf_model("gpt_neox"), tmp_path / "neox")
    assert "embed_out.weight" in safetensors.SafetensorsDir(path)  # what HF writes for the head
    fresh = hf_model("gpt_neox", seed=1)
    assert load_pretrained(fresh, path) == []
    assert _equal_states(fresh, hf_model("gpt_neox"))


def test_base_model_prefix_is_added_or_removed(tmp_path):
    base = transformers.GPT2Model(hf_model("gpt2").config)
    path = _save(base, tmp_path / "gpt2-base")  # names without "transformer."
    head = hf_model("gpt2", seed=1)
    load_pretrained(head, path)
    assert _equal_states(head.transformer, base) and torch.equal(head.lm_head.weight, base.wte.weight)
    causal = hf_model("llama")
    path = _save(causal, tmp_path / "llama")  # names with "model."; lm_head.weight is left unused
    body = transformers.LlamaModel(causal.config)
    load_pretrained(body, path)
    assert _equal_states(body, causal.model)


class Renamed(nn.Module):
    """A model whose class maps old checkpoint names onto its own (transformers 4.x)."""

    _checkpoint_conversion_mapping = {r"^encoder\.": "body.", r"^proj\.": "head."}

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)


def test_class_checkpoint_conversion_mapping(tmp_path):
    old = Renamed()
    path = str(tmp_path / "old.safetensors")
    safetensors.write(path, {k.replace("body.", "encoder.").replace("head.", "proj."): v
                             for k, v in old.state_dict().items()})
    fresh = Renamed()
    load_pretrained(fresh, path)
    assert _equal_states(fresh, old)


def test_key_map_as_dict_or_callable(tmp_path):
    saved = hf_model("gpt2")
    path = _save(saved, tmp_path / "gpt2")
    blocks = _renamed(path, tmp_path / "blocks", lambda n: n.replace("transformer.h.", "blocks."))
    fresh = hf_model("gpt2", seed=1)
    load_pretrained(fresh, blocks, key_map=lambda n: n.replace("transformer.h.", "blocks."))
    assert _equal_states(fresh, saved)
    embed = _renamed(path, tmp_path / "embed", lambda n: "tok_embed" if n == "transformer.wte.weight" else n)
    fresh = hf_model("gpt2", seed=1)
    load_pretrained(fresh, embed, key_map={"transformer.wte.weight": "tok_embed"})  # the others as they are
    assert _equal_states(fresh, saved)
    with pytest.raises(TypeError, match="key_map must be a dict"):
        load_pretrained(fresh, embed, key_map=["tok_embed"])


def test_error_lists_missing_beside_unused_file_keys(tmp_path):
    path = _save(hf_model("gpt2"), tmp_path / "gpt2")
    typo = _renamed(path, tmp_path / "typo", lambda n: n.replace("ln_f.", "ln_final."))
    with pytest.raises(StateDictError) as error:
        load_pretrained(hf_model("gpt2", seed=1), typo)
    message = str(error.value)
    assert "missing keys (2): transformer.ln_f.weight, transformer.ln_f.bias" in message
    assert "unused file keys (2): transformer.ln_final.bias, transformer.ln_final.weight" in message
    assert "key_map=" in message
    with pytest.raises(StateDictError, match=r"transformer.ln_f.weight \(as nowhere.weight\)"):
        load_pretrained(hf_model("gpt2", seed=1), typo, key_map={"transformer.ln_f.weight": "nowhere.weight"})
    missing = load_pretrained(hf_model("gpt2", seed=1), typo, strict=False)
    assert missing == ["transformer.ln_f.weight", "transformer.ln_f.bias"]


def test_fp8_gpt2_reads_hf_conv1d_weights_transposed(tmp_path):
    saved = hf_model("gpt2")
    path = _save(saved, tmp_path / "gpt2")
    fresh = hf_model("gpt2", seed=1)
    convert_to_fp8(fresh, Float8CurrentScaling())
    load_pretrained(fresh, path)
    transposed = {f"{n}.weight" for n, m in fresh.named_modules() if isinstance(m, Float8Conv1D)}
    assert len(transposed) == 8
    for name, want in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], want.t() if name in transposed else want), name
    # Files holding the converted (out, in) layout (an fsdp8 export of such a model) load as they are.
    exported = str(tmp_path / "fsdp8.safetensors")
    safetensors.write(exported, {k: v for k, v in fresh.state_dict().items() if k != "lm_head.weight"})
    again = hf_model("gpt2", seed=2)
    convert_to_fp8(again, Float8CurrentScaling())
    load_pretrained(again, exported)
    assert _equal_states(again, fresh)
    assert isinstance(again.lm_head, Float8Linear)


# -- activation checkpointing of decoder layers -----------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_layers_recompute_without_the_kv_cache(kind, mode):
    # The model makes a KV cache (use_cache defaults to True) and passes it to every layer under
    # this transformers' name for it, by keyword (Llama) or by position (GPT-2). A recomputation
    # that appended to it again would attend to twice the keys: selective checkpointing refuses
    # the changed op sequence (full recomputation happens to slice the extra keys off again).
    # Gradients must equal the run without checkpointing.
    from fsdp8.parallel.checkpointing import checkpoint_units
    from fsdp8.models.hf_adapter import decoder_layers, without_cache

    reference, model = hf_model(kind), hf_model(kind)
    is_layer = decoder_layers(model)
    checkpoint_units([m for n, m in model.named_modules() if is_layer(n, m)], mode, filter_call=without_cache)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for m in (reference, model):
        m(input_ids=tokens, labels=tokens).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("name", ["cache", "past_key_values", "past_key_value", "layer_past"])
def test_without_cache_drops_every_transformers_name_of_the_cache(name):
    from fsdp8.models.hf_adapter import without_cache

    cache = object()
    scope = {}
    exec(f"def forward(hidden, {name}=None, mask=None, *rest, use_cache=False, **kwargs): pass", scope)
    adapt = without_cache(scope["forward"])
    assert adapt((1, cache, 2, cache), {"use_cache": True}) == ((1, None, 2, cache), {"use_cache": False})
    assert adapt((1,), {name: cache, "use_cache": True, "position_ids": 3}) == (
        (1,), {name: None, "use_cache": False, "position_ids": 3})
    assert adapt((1, None), {"position_ids": 3}) == ((1, None), {"position_ids": 3})
