"""ParallelConfig validation, batch rows and the checks parallelize makes before any process group exists."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel

import fsdp8
from fsdp8 import ParallelConfig
from fsdp8.engine import OuterStrategy, Strategy
from fsdp8.parallel.manager import take_rows


def test_defaults_and_normalised_strategies():
    c = ParallelConfig()
    assert (c.dp_replicate, c.dp_shard, c.cp, c.tp) == (1, -1, 1, 1)
    assert c.strategy is Strategy.OPTIM_GRADS_PARAMS and c.outer_strategy is OuterStrategy.NO_SHARD
    assert c.activation_checkpointing == "none" and c.precision is None and c.offload is None
    assert ParallelConfig(strategy=1).strategy is Strategy.OPTIM
    with pytest.raises(Exception):
        c.tp = 2  # frozen
    ok = ParallelConfig(dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=True, loss_parallel=True,
                        tp_plan={"layers.*.wq": ColwiseParallel(), "head": None}, activation_checkpointing="selective",
                        compile={"mode": "max-autotune"}, fp8=fsdp8.Float8CurrentScaling(), outer_strategy="optim",
                        precision=fsdp8.Precision(param_dtype=torch.bfloat16), units=[nn.Linear], offload="optim")
    assert ok.outer_strategy is OuterStrategy.OPTIM
    # tp inferred: sequence parallel is checked against the world's tp at parallelize time.
    assert ParallelConfig(dp_shard=2, tp=-1, sequence_parallel=True).tp == -1
    assert ParallelConfig(cp=2, activation_checkpointing="full").cp == 2
    assert ParallelConfig(ep=2, tp=2, sequence_parallel=True).ep == 2  # experts expert-parallel beside tp
    assert ParallelConfig(ep=2, tp=2, compile=True).compile is True  # and compiled


BAD = [
    (dict(ep=0), ValueError, "ParallelConfig.ep must be a positive int (the expert-parallel ranks), got 0"),
    (dict(ep=True), ValueError, "ParallelConfig.ep must be a positive int"),
    (dict(tp=0), ValueError, "ParallelConfig.tp must be a positive int or -1 (inferred), got 0"),
    (dict(dp_replicate=-2), ValueError, "dp_replicate must be a positive int or -1"),
    (dict(tp=True), ValueError, "ParallelConfig.tp must be a positive int"),
    (dict(dp_shard=2.0), ValueError, "dp_shard must be a positive int"),
    (dict(tp=-1), ValueError, "only one mesh size may be -1 (inferred), got dp_shard and tp; dp_shard defaults to -1"),
    (dict(cp=2, activation_checkpointing="selective"), NotImplementedError,
     "activation_checkpointing='selective' with cp=2: the context-parallel attention builds its causal mask"),
    (dict(sequence_parallel=True), ValueError,
     "sequence_parallel need tensor parallelism, but tp=1; set tp=N (N > 1 dividing the world) or drop "
     "sequence_parallel"),
    (dict(loss_parallel=True, sequence_parallel=True), ValueError, "sequence_parallel and loss_parallel need tensor"),
    (dict(tp_plan={"head": ColwiseParallel()}), ValueError, "tp_plan need tensor parallelism, but tp=1"),
    (dict(tp=2, tp_plan={"head": "colwise"}), TypeError,
     "ParallelConfig.tp_plan['head'] = 'colwise': keys are fnmatch patterns over module names, values torch "
     "ParallelStyles"),
    (dict(tp=2, tp_plan=[("head", ColwiseParallel())]), TypeError, "tp_plan must be a dict of module pattern"),
    (dict(outer_strategy="optim"), ValueError,
     "outer_strategy='optim' shards across HSDP replicas, but dp_replicate=1 makes none; set dp_replicate > 1"),
    (dict(strategy="zero3"), ValueError, "unknown strategy 'zero3'"),
    (dict(dp_replicate=2, outer_strategy="optim_grads"), ValueError, "unknown outer_strategy"),
    (dict(activation_checkpointing="op"), ValueError,
     "activation_checkpointing='op': use one of 'none', 'full', 'selective'"),
    (dict(activation_checkpointing=True), ValueError, "activation_checkpointing=True: use one of"),
    (dict(compile="yes"), TypeError, "compile must be True, False or a dict of torch.compile keyword arguments"),
    (dict(fp8="fp8-current"), TypeError, "ParallelConfig.fp8 must be an fsdp8 FP8 recipe"),
    (dict(precision=torch.bfloat16), TypeError, "ParallelConfig.precision must be fsdp8.Precision or None"),
    (dict(units=["LlamaDecoderLayer"]), TypeError, "units must be nn.Module classes or a callable"),
    (dict(units=[]), TypeError, "units must be nn.Module classes"),
    (dict(units=3), TypeError, "units must be nn.Module classes"),
    (dict(offload="cpu"), ValueError, "ParallelConfig.offload='cpu': use None or 'optim'"),
    (dict(offload="optim", strategy="no_shard"), ValueError,
     "strategy='no_shard' shards nothing; use strategy='optim' or higher with offload"),
    (dict(reshard_after_forward=1), TypeError, "reshard_after_forward must be True or False, got 1"),
    (dict(skip_packed_sequence_check="yes"), TypeError, "skip_packed_sequence_check must be True or False"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[str(k) for k, _, _ in BAD])
def test_invalid_configs_say_what_to_do(kwargs, error, message):
    with pytest.raises(error) as info:
        ParallelConfig(**kwargs)
    assert message in str(info.value)


def test_parallelize_checks_before_any_process_group():
    # Raised before init_distributed: nothing collective can have started.
    with pytest.raises(ValueError, match="skip_packed_sequence_check replaces a check of Hugging Face attention, "
                                         "but Sequential is not a transformers model; drop the option"):
        fsdp8.parallelize(nn.Sequential(nn.Linear(2, 2)), ParallelConfig(skip_packed_sequence_check=True))
    with pytest.raises(TypeError, match=r"parallelize takes a fsdp8.ParallelConfig or 'auto', got \{'tp': 2\}"):
        fsdp8.parallelize(nn.Linear(2, 2), {"tp": 2})
    with pytest.raises(TypeError, match="parallelize expects an nn.Module, got str"):
        fsdp8.parallelize("model")


def test_take_rows():
    ids, labels = torch.arange(24).view(6, 4), torch.arange(24).view(6, 4) + 100
    positions = torch.arange(4)[None]
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions, "scale": torch.tensor(2.0),
             "use_cache": False, "note": None}
    part = take_rows(batch, 1, 3)
    assert torch.equal(part["input_ids"], ids[2:4]) and torch.equal(part["labels"], labels[2:4])
    assert part["position_ids"] is positions and part["scale"] is batch["scale"]  # broadcast row, 0-d: whole
    assert part["use_cache"] is False and part["note"] is None
    assert part["input_ids"].data_ptr() == ids[2:4].data_ptr()  # a view, nothing copied
    assert torch.equal(take_rows({"x": ids}, 0, 1)["x"], ids)
    assert torch.equal(take_rows({"x": ids[:1]}, 0, 1)["x"], ids[:1])


@pytest.mark.parametrize("batch,size,error,message", [
    ({"input_ids": torch.zeros(6, 4)}, 4, ValueError,
     "the global batch has 6 rows, which 4 data-parallel ranks cannot split evenly; make the global batch size a "
     "multiple of model.dp_size = 4"),
    ({"input_ids": torch.zeros(6, 4), "labels": torch.zeros(4, 4)}, 2, ValueError,
     "the batch's tensors disagree on the number of rows: {'input_ids': 6, 'labels': 4}"),
    ({"input_ids": torch.zeros(4, 4), "texts": ["a", "b", "c", "d"]}, 2, TypeError,
     "cannot tell whether batch['texts'] (list) holds one entry per row; leave it out, or cut it yourself"),
    ({"flag": True}, 2, ValueError, "found no tensor with a batch dimension"),
    ([torch.zeros(4, 4)], 2, TypeError, "shard_batch takes a dict of tensors (input_ids, labels, ...), got list"),
])
def test_take_rows_errors(batch, size, error, message):
    with pytest.raises(error) as info:
        take_rows(batch, 0, size)
    assert message in str(info.value)


def test_hf_gradient_checkpointing_and_ours_together_are_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    # transformers 5.2x renamed gradient_checkpointing_* to activation_checkpointing_*.
    name = "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing"
    getattr(model, f"{name}_enable")()
    with pytest.raises(ValueError, match="Hugging Face gradient checkpointing enabled as well as "
                                         "activation_checkpointing='full', which would recompute twice; call "
                                         f"model.{name}_disable\\(\\)"):
        fsdp8.parallelize(model, ParallelConfig(activation_checkpointing="full"))


def test_auto_says_once_which_layout_it_chose_and_why(capsys):
    from fsdp8.models.llama import Llama, preset
    from fsdp8.planner import search

    torch.manual_seed(0)
    model = fsdp8.parallelize(Llama(preset("tiny")), "auto")
    best = search("tiny", gpus_per_node=1, top=1)[0]  # what a world of one predicts
    assert model.parallel_config == best.parallel
    strategy = best.parallel.strategy.label
    assert capsys.readouterr().err.splitlines() == [
        f"fsdp8.parallelize: 'auto' chose dp_replicate 1 x dp_shard 1 x cp 1 x tp 1, strategy {strategy}: the "
        "fastest layout that fits on 1 h100 GPU (the planner's figures for the CPU ranks here: only the ranking "
        f"counts), predicted {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU and {best.plan.memory.total / 2**30:.1f} "
        "GiB per GPU with 1 sequence(s) of 2048 tokens per rank (model.parallel_config holds it)"]


@pytest.mark.parametrize("hashes_symbolic,tp,cp,user,expected", [
    (False, 2, 1, True, {"dynamic": False}),  # torch < 2.13 under TP: static shapes
    (False, 2, 2, {"mode": "max-autotune"}, {"mode": "max-autotune", "dynamic": False}),
    (False, 1, 2, True, {}),  # cp alone: no DTensor parameters or inputs
    (False, 2, 1, {"dynamic": True}, {"dynamic": True}),  # the user's choice stands
    (False, 1, 1, True, {}),  # no DTensor inputs: torch's default
    (True, 2, 1, True, {}),  # torch >= 2.13 hashes symbolic shapes
])
def test_compile_options_keep_shapes_static_where_dtensor_cannot_hash_symbols(monkeypatch, hashes_symbolic, tp, cp,
                                                                              user, expected):
    from fsdp8.parallel import manager

    monkeypatch.setattr(manager, "_DTENSOR_HASHES_SYMBOLIC_SHAPES", hashes_symbolic)
    assert manager.compile_options(ParallelConfig(tp=tp, cp=cp, compile=user)) == expected
