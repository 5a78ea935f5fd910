"""Model adapters (fsdp8/models/adapter.py): which adapter a model gets, the generic answers, and what
registering one changes (no processes; parallelize with a registered adapter: tests/dist/test_parallelize.py)."""

import pytest
import torch.nn as nn

from fsdp8.fp8 import swiglu_forms
from fsdp8.fp8.mlp import fuse_swiglu_mlps
from fsdp8.fp8.recipes import Float8BlockScaling
from fsdp8.models import ModelAdapter, adapter_for, register_adapter
from fsdp8.models import adapter as registry
from fsdp8.models.hf_adapter import HFAdapter
from fsdp8.models.llama import Llama, LlamaConfig
from fsdp8.models.llama_adapter import LlamaAdapter
from fsdp8.models.spec import ModelSpec


def _llama() -> Llama:
    return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16))


@pytest.fixture
def registrations(monkeypatch):
    """Registrations made in the test are undone after it."""
    monkeypatch.setattr(registry, "_REGISTERED", list(registry._REGISTERED))
    monkeypatch.setattr(swiglu_forms, "_FORMS", list(swiglu_forms._FORMS))


def test_the_built_in_families_have_their_adapters():
    llama = _llama()
    assert type(adapter_for(llama)) is LlamaAdapter
    assert adapter_for(llama).planner_spec(llama) == ModelSpec("model", 2, 32, 64, 4, 2, 64)
    assert adapter_for(llama).tp_plan(llama, False, False).vocab_modules == ("embed", "head")
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    assert type(adapter_for(hf)) is HFAdapter
    is_unit = adapter_for(hf).units(hf)
    assert [name for name, m in hf.named_modules() if is_unit(name, m)] == ["model.layers.0", "model.layers.1"]


def test_a_model_of_ones_own_gets_the_generic_answers():
    model = nn.Sequential(nn.Linear(4, 4))
    adapter = adapter_for(model)
    assert type(adapter) is ModelAdapter
    assert adapter.units(model) is None and adapter.tp_plan(model, True, True) is None
    assert adapter.checkpoint_filter(model) is None and adapter.experts(model) == {}
    assert not adapter.supports_context_parallel(model)
    with pytest.raises(ValueError, match="context_parallel knows fsdp8's Llama and Hugging Face models, not "
                                         "Sequential; in your own model's attention call attend = "):
        adapter.context_parallel(model, attention=None)
    with pytest.raises(ValueError, match="parallelize\\(model, 'auto'\\) plans fsdp8's Llama and Hugging Face "
                                         "Llama-family models, not Sequential; pass a fsdp8.ParallelConfig"):
        adapter.planner_spec(model)
    with pytest.raises(ValueError, match="skip_packed_sequence_check replaces a check of Hugging Face attention"):
        adapter.skip_packed_sequence_check(model)


class _GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)


class _Mine(ModelAdapter):
    def claims(self, model):
        return isinstance(model, Llama)

    def swiglu_names(self, module):
        return ("a", "b", "c") if type(module) is _GatedMLP else None


def test_the_latest_registered_adapter_claims_first_and_names_its_mlps(registrations):
    llama, mlp = _llama(), _GatedMLP()
    assert fuse_swiglu_mlps(mlp, Float8BlockScaling()) == 0
    mine = _Mine()
    register_adapter(mine)
    assert adapter_for(llama) is mine  # over the built-in Llama's
    assert type(adapter_for(nn.Linear(2, 2))) is ModelAdapter
    assert fuse_swiglu_mlps(mlp, Float8BlockScaling()) == 1
    assert type(mlp).__name__ == "Float8SwiGLU_GatedMLP" and mlp._fsdp8_swiglu == ("a", "b", "c")
    with pytest.raises(TypeError, match="register_adapter takes a fsdp8.models.ModelAdapter instance, got type"):
        register_adapter(_Mine)
