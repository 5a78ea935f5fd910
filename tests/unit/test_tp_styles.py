"""Hugging Face tensor-parallel style strings as torch ParallelStyles (no processes)."""

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from fsdp8.fp8.tp import Float8ColwiseParallel
from fsdp8.parallel.tp_hf import _style


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
