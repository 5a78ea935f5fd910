"""The host probe of `fsdp8 bench` (fsdp8/app/bench/host.py) and how the planner uses a measured host:
the probe's tiny model keeps the architecture and which linears are FP8, the fit recovers a
layer's and the root's cost, and a measured host sets the step when it is the slower side."""

from __future__ import annotations

import pytest

from fsdp8 import ParallelConfig
from fsdp8.app.bench.command import bench_config
from fsdp8.app.bench.config import BenchConfig
from fsdp8.app.bench.host import fit_host_cost, probe_config, probe_depths, probe_spec
from fsdp8.app.cli import build_parser
from fsdp8.planner import plan
from fsdp8.planner.hardware import Efficiency, HostCost
from fsdp8.planner.model import FP8_RECIPES, converts_to_fp8, model_spec

MODEL_A = dict(layers=16, hidden=2048, ffn=8192, heads=16, kv_heads=8, vocab=32000)


@pytest.mark.parametrize("model,sizes", [("tiny", {}), ("1b", {}), ("8b", {}), (None, MODEL_A),
                                         ("tiny", dict(heads=4, kv_heads=4))])
@pytest.mark.parametrize("tp", [1, 2])
def test_probe_model_keeps_the_architecture_and_its_fp8_linears(model, sizes, tp):
    spec = model_spec(model, **sizes)
    small = probe_spec(spec, 3, tp)
    assert (small.layers, small.heads, small.kv_heads, small.tied, small.family) == \
        (3, spec.heads, spec.kv_heads, spec.tied, spec.family)
    assert small.hidden == small.q_dim and small.hd % 2 == 0 and small.hd >= 16  # the fsdp8 Llama's head_dim
    assert small.hidden * small.ffn < spec.hidden * spec.ffn or spec.hidden <= 512
    for recipe in FP8_RECIPES:
        for big, little in zip(spec.block_params(), small.block_params()):
            assert converts_to_fp8(big, recipe, tp, 0) == converts_to_fp8(little, recipe, tp, 0), (recipe, big.name)


def test_probe_config_is_one_short_sequence_the_layout_can_split():
    parallel = ParallelConfig(cp=2, tp=2, sequence_parallel=True)
    cfg = probe_config(BenchConfig(seq_len=4096, micro_batch=8, accumulation=3, parallel=parallel))
    assert (cfg.micro_batch, cfg.accumulation, cfg.seq_len % (2 * 2 * 2)) == (1, 3, 0)
    assert cfg.seq_len < 4096


def test_fit_recovers_layer_and_root_costs_and_keeps_the_models_own_depth_exact():
    assert probe_depths(16) == (8, 16) and probe_depths(7) == (3, 7)
    true, acc = HostCost(layer_fwd=0.004, layer_bwd=0.009, root_fwd=0.002, root_bwd=0.005), 3
    point = lambda n: (acc * (n * true.layer_fwd + true.root_fwd), acc * (n * true.layer_bwd + true.root_bwd))  # noqa: E731
    depths = probe_depths(16)
    fitted = fit_host_cost(point(depths[0]), point(depths[1]), depths, acc)
    for name in ("layer_fwd", "layer_bwd", "root_fwd", "root_bwd"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name)), name
    # Noise that would make a share negative moves it to the other; the whole model's total,
    # which the probe measured, stays what it measured.
    noisy = fit_host_cost((0.010, 0.020), (0.009, 0.030), (2, 4), 1)
    assert (noisy.layer_fwd, noisy.root_fwd) == (0.0, pytest.approx(0.009))
    assert noisy.layer_bwd == pytest.approx(0.005) and noisy.root_bwd == pytest.approx(0.010)
    steep = fit_host_cost((0.001, 0.001), (0.020, 0.030), (2, 4), 2)
    assert steep.root_fwd == 0.0 and 4 * steep.layer_fwd == pytest.approx(0.010)
    assert 4 * steep.layer_bwd + steep.root_bwd == pytest.approx(0.015)


def test_a_measured_host_replaces_the_per_op_model_and_bounds_each_pass():
    kw = dict(gpu="h200", gpus_per_node=1, seq_len=2048, micro_batch=4, global_batch=8, **MODEL_A)
    gpu_bound = plan(None, **kw).time
    assert gpu_bound.step == pytest.approx(gpu_bound.compute + gpu_bound.exposed + gpu_bound.optimizer)
    slow_forward = HostCost(layer_fwd=0.02, layer_bwd=0.0, root_fwd=0.001, root_bwd=0.0)
    t = plan(None, efficiency=Efficiency(host=slow_forward), **kw).time
    acc, layers = 2, MODEL_A["layers"]
    assert t.host == pytest.approx(acc * (layers * 0.02 + 0.001)) and t.host_fwd == pytest.approx(t.host)
    assert t.compute == pytest.approx(gpu_bound.compute)
    # The host sets forward; backward, with nothing to issue, is the GPU's: a host ahead in
    # forward does not shorten it.
    assert t.issue_bound == pytest.approx(t.host + (t.compute - t.compute_fwd))
    assert t.step == pytest.approx(t.issue_bound + t.exposed + t.optimizer)
    assert t.step > max(t.host, t.compute) + t.exposed + t.optimizer
    with pytest.raises(ValueError, match="HostCost.layer_bwd must be seconds >= 0"):
        HostCost(0.1, -1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="Efficiency.host must be a HostCost"):
        Efficiency(host=0.5)

def test_tensor_parallel_collectives_run_in_a_slow_hosts_shadow():
    # TP collectives run on the compute stream and the host issues them among the layers' kernels:
    # a GPU-bound step adds them to its compute, a host-bound one hides them in the host's time.
    kw = dict(gpu="h200", gpus_per_node=2, seq_len=2048, micro_batch=4, global_batch=4,
              parallel=ParallelConfig(tp=2, sequence_parallel=True), **MODEL_A)
    gpu_bound = plan(None, **kw).time
    assert gpu_bound.model_parallel > 0
    assert gpu_bound.step == pytest.approx(gpu_bound.compute + gpu_bound.model_parallel + gpu_bound.exposed
                                           + gpu_bound.optimizer)
    layers = MODEL_A["layers"]
    slow = HostCost(layer_fwd=2 * gpu_bound.compute / layers, layer_bwd=2 * gpu_bound.compute / layers,
                    root_fwd=0.0, root_bwd=0.0)
    t = plan(None, efficiency=Efficiency(host=slow), **kw).time
    assert t.host == pytest.approx(4 * gpu_bound.compute) and t.host > t.compute + t.model_parallel
    assert t.step == pytest.approx(t.host + t.exposed + t.optimizer)
    # A backward host slower than backward's compute alone but not than its compute and its share of
    # the collectives (split as the compute is): the stream still sets the step.
    g = gpu_bound
    compute_bwd = g.compute - g.compute_fwd
    stream_bwd = compute_bwd + (compute_bwd / g.compute) * g.model_parallel
    edge = HostCost(layer_fwd=0.0, layer_bwd=(compute_bwd + stream_bwd) / 2 / layers, root_fwd=0.0, root_bwd=0.0)
    t = plan(None, efficiency=Efficiency(host=edge), **kw).time
    assert compute_bwd < t.host < stream_bwd
    assert t.step == pytest.approx(g.step)



def test_bench_flag_turns_the_probe_off():
    parse = lambda *argv: bench_config(build_parser().parse_args(["bench", *argv]))  # noqa: E731
    assert parse().host_probe is True and parse("--no-host-probe").host_probe is False
