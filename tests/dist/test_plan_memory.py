"""The planner's persistent memory equals memory_report() byte for byte: every strategy and mesh,
fp32 / bf16 / each FP8 recipe, tensor parallelism, offload, mixtures of experts with and without
expert parallelism (and beside tensor parallelism) (fsdp8/planner/memory.py [Note: exact and estimated memory]).

The model's sizes make every layout rule count: a vocabulary (37) and widths that no world
size divides, one kv head (a 16-row weight), FP8 widths where MX scales cover a partial block,
and under tp=2 a vocabulary split unevenly (tp ranks hold different root sizes) and layers some
recipes keep in high precision."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp8 import ParallelConfig, Precision
from fsdp8.config import BF16_MIXED
from fsdp8.fp8.recipes import recipe_from_name
from fsdp8.models.llama import LlamaConfig
from fsdp8.models.spec import hf_spec_of, llama_spec
from fsdp8.planner.hardware import Cluster, gpu_named
from fsdp8.planner.memory import memory_report
from fsdp8.planner.model import ModelSpec
from fsdp8.planner.setup import make_setup
from tests.dist import plan_workers as workers
from tests.harness import run_on_ranks

SIZES = dict(vocab_size=37, dim=48, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=80)
TP_SIZES = dict(vocab_size=37, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)


def _spec(sizes: dict, tied: bool = False) -> ModelSpec:
    return ModelSpec("test", sizes["n_layers"], sizes["dim"], sizes["ffn_dim"], sizes["n_heads"], sizes["n_kv_heads"],
                     sizes["vocab_size"], tied=tied)


def _compare(world: int, spec, results, parallel_of) -> None:
    """Each rank's engine memory reports against the planner's for the same layout: ``results``
    holds (reports by case, tp rank) per rank; ``parallel_of(case)`` is the case's ParallelConfig."""
    cluster = Cluster(gpu_named("h100"), 1, world)
    wrong = []
    for rank, (reports, tp_rank) in enumerate(results):
        assert reports, "no case ran"
        for case, engine in reports.items():
            setup = make_setup(spec, cluster, parallel_of(case), seq_len=16)
            planned = dataclasses.asdict(memory_report(spec, setup, tp_rank))
            if planned != engine:
                wrong.append(f"{case} rank {rank} (tp rank {tp_rank}): planned {planned}, engine {engine}")
    assert not wrong, "\n".join(wrong)


def _fp8_and_precision(fp8, precision) -> dict:
    return dict(fp8=recipe_from_name(f"fp8-{fp8}") if fp8 else None,
                precision=BF16_MIXED if precision == "bf16" else Precision())


def _check(world: int, sizes: dict, mesh_shape=None, outer="no_shard", tp=1, offload=False, tied=False):
    results = run_on_ranks(world, workers.reports, dict(sizes, tie_embeddings=tied), mesh_shape, outer, tp, offload)

    def parallel_of(case):
        strategy, precision, fp8, off = case
        return ParallelConfig(dp_replicate=mesh_shape[0] if mesh_shape else 1, tp=tp, strategy=strategy,
                              outer_strategy=outer, offload="optim" if off else None,
                              **_fp8_and_precision(fp8, precision))

    _compare(world, _spec(sizes, tied), results, parallel_of)


@pytest.mark.parametrize("tied", [False, True])
def test_flat_world2(tied):
    _check(2, SIZES, tied=tied)


def test_flat_world4():
    _check(4, SIZES)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hsdp_2x2(outer):
    _check(4, SIZES, (2, 2), outer)


def test_dp2_tp2():
    _check(4, TP_SIZES, tp=2)


@pytest.mark.parametrize("mesh_shape,outer", [(None, "no_shard"), ((2, 2), "optim")])
def test_offload(mesh_shape, outer):
    _check(4, SIZES, mesh_shape, outer, offload=True)


# -- mixtures of experts: the experts a unit of their own under ep, sharded over efsdp ------------
# 6 experts: under ep 2 each rank's 3 split unevenly over efsdp 2 (a padded chunk); under ep 2 on
# a world of 2, efsdp is 1 (one chunk, which fp32 aliases).
MOE_SIZES = dict(vocab_size=37, dim=48, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=80, num_experts=6,
                 num_experts_per_tok=2, moe_ffn_dim=40)
# transformers' Qwen3-MoE with layer 1 of 3 dense: both kinds of layer in one model.
QWEN_SIZES = dict(MOE_SIZES, n_layers=3, head_dim=16, dense_layers=(1,))


def _moe_spec(family: str, sizes: dict) -> ModelSpec:
    if family == "fsdp8":
        return llama_spec(LlamaConfig(max_seq_len=16, **sizes), "moe")
    return hf_spec_of(workers.qwen3_moe_config(sizes).to_dict(), "qwen3_moe")


def _check_moe(world: int, family: str, sizes: dict, ep: int, dp_replicate: int = 1, outer: str = "no_shard",
               tp: int = 1, sequence_parallel: bool = False):
    results = run_on_ranks(world, workers.moe_reports, family, sizes, ep, dp_replicate, outer, tp, sequence_parallel)

    def parallel_of(case):
        strategy, precision, fp8 = case
        return ParallelConfig(dp_replicate=dp_replicate, ep=ep, tp=tp, sequence_parallel=sequence_parallel,
                              strategy=strategy, outer_strategy=outer, **_fp8_and_precision(fp8, precision))

    _compare(world, _moe_spec(family, sizes), results, parallel_of)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_world2(ep):
    _check_moe(2, "fsdp8", MOE_SIZES, ep)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_fp8_experts_world2(ep):
    # Experts of 48 x 48 convert (multiples of 16): their weights gather as FP8 bytes, one scale
    # (or 128x128 grid) per expert, MX scales with the bytes (engine/fp8_experts.py).
    _check_moe(2, "fsdp8", dict(MOE_SIZES, moe_ffn_dim=48), ep)


@pytest.mark.parametrize("ep", [2, 4])
def test_moe_world4(ep):
    _check_moe(4, "fsdp8", dict(MOE_SIZES, num_experts=8) if ep == 4 else MOE_SIZES, ep)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_moe_hsdp_2x2_ep2(outer):
    _check_moe(4, "fsdp8", MOE_SIZES, 2, dp_replicate=2, outer=outer)


def test_moe_ep2_tp2_sequence_parallel():
    # World 4 = dp_shard 2 x tp 2, ep 2 borrowed from dp_shard (efsdp 1): attention split over tp
    # (the vocabulary of 37 unevenly, so tp ranks hold different roots), router and experts whole
    # on every tp rank, each rank's 3 of the 6 experts.
    _check_moe(4, "fsdp8", dict(MOE_SIZES, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96), 2, tp=2,
               sequence_parallel=True)


def test_moe_hugging_face_dense_and_moe_layers_ep2():
    pytest.importorskip("transformers")
    _check_moe(4, "hf", QWEN_SIZES, 2)
