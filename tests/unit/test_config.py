"""Policies: parsing and validation."""

import pytest
import torch

from fsdp8 import Precision
from fsdp8.config import BF16_MIXED, resolve_precision
from fsdp8.engine import OuterStrategy, Strategy


@pytest.mark.parametrize("value,expected", [
    ("no_shard", Strategy.NO_SHARD), ("optim", Strategy.OPTIM), ("optim_grads", Strategy.OPTIM_GRADS),
    ("optim_grads_params", Strategy.OPTIM_GRADS_PARAMS), (0, Strategy.NO_SHARD), (3, Strategy.OPTIM_GRADS_PARAMS),
    ("2", Strategy.OPTIM_GRADS), (Strategy.OPTIM, Strategy.OPTIM), (" Optim ", Strategy.OPTIM),
])
def test_strategy_parse(value, expected):
    assert Strategy.parse(value) is expected


@pytest.mark.parametrize("value", ["zero3", 4, -1, True, None, 1.0])
def test_strategy_parse_rejects(value):
    with pytest.raises(ValueError, match="unknown strategy .* use one of 'no_shard', 'optim', 'optim_grads', 'optim_grads_params'"):
        Strategy.parse(value)


def test_outer_strategy():
    assert OuterStrategy.parse("optim") is OuterStrategy.OPTIM
    assert OuterStrategy.parse(0) is OuterStrategy.NO_SHARD
    with pytest.raises(ValueError, match="outer_strategy"):
        OuterStrategy.parse("optim_grads")


def test_precision_defaults_and_validation():
    p = Precision()
    assert p.compute_dtype == torch.float32 and p.grad_reduce_dtype == torch.float32 and not p.casts_inputs
    q = Precision(param_dtype=torch.bfloat16)
    assert q.grad_reduce_dtype == torch.bfloat16 and q.casts_inputs
    assert Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).grad_reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="param_dtype=torch.int8 is not a floating dtype"):
        Precision(param_dtype=torch.int8)
    with pytest.raises(Exception):
        p.param_dtype = torch.float16  # frozen


def test_automatic_precision_is_bf16_on_gpus_and_fp32_elsewhere():
    assert resolve_precision(None, "cuda") == BF16_MIXED == Precision(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.float32)
    assert resolve_precision(None, "cpu") == Precision() and resolve_precision(None, "meta") == Precision()
    chosen = Precision(param_dtype=torch.float16)
    assert resolve_precision(chosen, "cuda") is chosen and resolve_precision(chosen, "cpu") is chosen
    assert (BF16_MIXED.label, Precision().label, chosen.label) == ("bf16", "fp32", "fp16")
