"""Hugging Face tensor-parallel style strings as torch ParallelStyles (no processes)."""

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from fsdp8.fp8.tp import Float8ColwiseParallel
from fsdp8.models.hf_tp import _style


@pytest.mark.parametrize("sp", [False, True])
def test_style_strings(sp):
    seq = Shard(1) if sp else None
    colwise = _style("colwise", sp)
    assert isinstance(colwise, Float8ColwiseParallel)  # gathers its own input in FP8 when converted
    rowwise = _style("rowwise", sp)
    assert isinstance(rowwise, RowwiseParallel) and rowwise.output_layouts == (seq or Replicate(),)
    # transformers 5.17 names the embedding's style; both shard and place as fsdp8's embedding.
    embed = _style("embedding_rowwise", sp)
    assert isinstance(embed, RowwiseParallel) and embed.input_layouts == (Replicate(),)
    assert embed.output_layouts == (seq or Replicate(),)
    assert isinstance(_style("embedding_colwise", sp), ColwiseParallel)
    assert isinstance(_style("sequence_parallel", sp), SequenceParallel)
    assert _style("packed_colwise", sp) is None  # no torch equivalent: reported by tensor_parallel


def test_embedding_in_the_plan_keeps_sequence_parallel_norms():
    # transformers 5.17 adds "embed_tokens": "embedding_rowwise" to a tied model's plan; that
    # must not make the base model an "owner" of split projections and strip its norms.
    transformers = pytest.importorskip("transformers")
    from fsdp8.models import adapter_for

    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config)
    plan = dict(config.base_model_tp_plan)
    plan["embed_tokens"] = "embedding_rowwise"
    config.base_model_tp_plan = plan
    styles = adapter_for(model).tp_plan(model, sequence_parallel=True, loss_parallel=False).styles
    norms = [n for n, s in styles.items() if isinstance(s, SequenceParallel)]
    assert "model.norm" in norms and "model.layers.0.input_layernorm" in norms, norms


def test_router_output_gathered_over_tp_comes_back_in_sequence_order():
    # ExpertParallelBlock gathers each tp rank's [batch, local sequence] rows rank-major; the
    # load-balancing loss (an attention mask, with Hugging Face models) pairs them with [batch, sequence].
    import torch

    from fsdp8.models.tp_plan import _in_sequence_order

    tokens = torch.arange(2 * 6).view(2, 6, 1).float()  # batch 2, sequence 6, one feature
    per_rank = [tokens[:, r * 2:(r + 1) * 2].reshape(-1, 1) for r in range(3)]  # tp 3, 2 positions each
    assert torch.equal(_in_sequence_order(torch.cat(per_rank), 3, (2, 2)), tokens.reshape(-1, 1))
