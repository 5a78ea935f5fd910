"""The planner on mixture-of-experts models, without processes: total and active parameters against the
real models, what an MoE layer keeps for backward against autograd, the experts' units under expert
parallelism, the all-to-all traffic, the search over ep, validation, and `fsdp8 plan --ep`.
(tests/dist/test_plan_memory.py sets the persistent memory beside memory_report() on gloo ranks.)"""

from __future__ import annotations

import json

import pytest
import torch

from fsdp8 import ParallelConfig, Precision
from fsdp8.models.llama import Llama, LlamaConfig, preset
from fsdp8.models.spec import llama_spec
from fsdp8.planner import plan, search
from fsdp8.planner.activations import activations, routed_bytes
from fsdp8.planner.compute import compute
from fsdp8.planner.hardware import Cluster, gpu_named
from fsdp8.planner.memory import layer_groups, memory_report, unit_plans
from fsdp8.planner.model import ModelSpec, model_spec
from fsdp8.planner.predict import plan_setup
from fsdp8.planner.setup import make_setup
from fsdp8.planner.links import collective_seconds, groups
from fsdp8.planner.time import host_syncs
from tests.unit.test_plan import saved_by_first_block

H100 = gpu_named("h100")


def _setup(spec, world=8, gpus_per_node=8, parallel=None, **kw):
    kw.setdefault("seq_len", 2048)
    return make_setup(spec, Cluster(H100, world // gpus_per_node, gpus_per_node), parallel, **kw)


def _moe(**changes) -> ModelSpec:
    """A small mixture of experts: 4 layers of hidden 256, 8 experts of 128, top 2."""
    sizes = dict(name="moe", layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=1000, experts=8,
                 experts_per_token=2, expert_ffn=128)
    return ModelSpec(**dict(sizes, **changes))


# -- parameters ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,tied", [("moe-tiny", False), ("moe-1b", False), ("moe-tiny", True)])
def test_preset_total_and_active_parameters_match_the_built_in_llama(name, tied):
    with torch.device("meta"):
        model = Llama(preset(name, tie_embeddings=tied))
    spec = model_spec(name, tied=tied)
    assert (spec.num_params, spec.num_active_params) == (model.num_params(), model.num_active_params())
    assert spec.flops_per_token(2048) == model.flops_per_token(2048)
    assert spec.moe_layers == spec.layers and spec.layer_kinds() == [("moe", spec.layers)]


@pytest.mark.parametrize("kind,extra,moe_layers", [
    # decoder_sparse_step 2 makes layers 1 and 3 mixtures; mlp_only_layers keeps 3 dense.
    ("qwen3_moe", dict(num_experts=6, moe_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[3]), 1),
    ("qwen3_moe", dict(num_experts=6, moe_intermediate_size=24), 4),
    ("mixtral", dict(num_local_experts=6), 4),
])
def test_hf_config_json_counts_the_parameters_transformers_builds(tmp_path, kind, extra, moe_layers):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(kind, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=99,
                                               num_experts_per_tok=2, **extra)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = model_spec(f"hf:{tmp_path}")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert spec.moe_layers == moe_layers and spec.num_params == total
    assert spec.num_active_params == total - experts // 6 * (6 - 2)  # 2 of each layer's 6 experts run
    from fsdp8.models import adapter_for

    assert adapter_for(model).planner_spec(model).num_params == total  # what parallelize(model, "auto") plans


def test_hf_expert_fields_are_checked(tmp_path):
    config = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 99, "num_local_experts": 4, "num_experts_per_tok": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_experts_per_tok is 0, not a positive integer"):
        model_spec(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_local_experts=0)))
    assert model_spec(f"hf:{tmp_path}").experts == 0  # no experts: a dense model
    with pytest.raises(ValueError, match="experts need 1 <= experts_per_token <= 8"):
        _moe(experts_per_token=9)


# -- activations -----------------------------------------------------------------------------------
def test_moe_activation_formula_counts_what_autograd_saves():
    """One built-in MoE Llama block in fp32 on the CPU: the bytes of every tensor autograd saves
    (parameters and the rotary tables excluded) against activations.py's formula for AC none."""
    cfg = LlamaConfig(vocab_size=37, dim=48, n_layers=1, n_heads=3, n_kv_heads=1, ffn_dim=80, max_seq_len=16,
                      num_experts=6, num_experts_per_tok=2, moe_ffn_dim=40)
    saved = saved_by_first_block(cfg)
    spec = llama_spec(cfg, "moe")
    fp32 = ParallelConfig(precision=Precision())
    per_token = activations(spec, _setup(spec, world=1, gpus_per_node=1, parallel=fp32, seq_len=16, micro_batch=2),
                            {}, "moe").saved
    # On the CPU, SDPA's output is head-major, so wo's input is a copy (on CUDA it is a view). Per
    # layer, not per token: the grouped GEMM's int32 group ends and the load-balancing loss's
    # fp32 vector over the experts.
    cpu_copy, per_layer = 4 * spec.q_dim * 2 * 16, (4 + 4) * spec.experts
    assert sum(saved.values()) == per_token * 2 * 16 + cpu_copy + per_layer


def test_checkpointing_recomputes_the_experts():
    spec = model_spec("moe-1b")
    kept = {ac: activations(spec, _setup(spec, parallel=ParallelConfig(activation_checkpointing=ac)), {}, "moe").saved
            for ac in ("none", "selective", "full")}
    # Selective keeps wq's, wv's and the router's outputs, nothing of the routed rows.
    assert kept["full"] == 2 * spec.hidden < kept["selective"] < 2 * spec.hidden * spec.experts_per_token < kept["none"]


# -- the experts' units and memory -----------------------------------------------------------------
def test_under_ep_the_experts_are_a_unit_sharded_over_efsdp():
    spec = _moe()
    one = unit_plans(spec, _setup(spec))
    assert [u.name for u in one] == ["root", "moe layer"]  # the experts inside the layer's unit
    four = unit_plans(spec, _setup(spec, parallel=ParallelConfig(ep=4)))
    assert [u.name for u in four] == ["root", "moe layer", "experts"]
    experts = four[2]
    # 2 of the 8 experts on each ep rank, sharded over efsdp = 8 / 4 = 2 chunks.
    assert experts.experts and experts.chunks == 2 and four[1].chunks == 8
    assert experts.local_numel == 2 * 3 * spec.expert_ffn * spec.hidden
    assert experts.unsharded_bytes == experts.local_numel * 2  # bf16, no padding at these sizes
    assert [g.units for g in layer_groups(four)] == [(four[1], experts)]
    # Each rank holds a 1/8 of everything either way; what is gathered at once shrinks with ep.
    assert abs(memory_report(spec, _setup(spec)).main_weights
               - memory_report(spec, _setup(spec, parallel=ParallelConfig(ep=4))).main_weights) < 64
    small_root = _moe(vocab=16)  # so that a layer's units are the largest
    largest = [memory_report(small_root, _setup(small_root, parallel=ParallelConfig(ep=ep))).largest_unsharded_unit
               for ep in (1, 2, 4, 8)]
    assert largest == sorted(largest, reverse=True) and largest[0] > 3 * largest[-1]


def test_a_model_of_dense_and_moe_layers_plans_both_kinds():
    spec = _moe(moe_step=2, dense_layers=(3,))  # layer 1 is a mixture of experts, 0, 2 and 3 dense
    assert spec.moe_layers == 1 and spec.layer_kinds() == [("dense", 3), ("moe", 1)]
    setup = _setup(spec, parallel=ParallelConfig(ep=2))
    assert [(u.name, u.count) for u in unit_plans(spec, setup)] == [("root", 1), ("layer", 3), ("moe layer", 1),
                                                                    ("experts", 1)]
    p = plan(spec, ParallelConfig(ep=2))
    assert p.memory.fits and p.time.step > 0
    assert p.spec.num_active_params < p.spec.num_params


# -- time ------------------------------------------------------------------------------------------
def test_flops_follow_the_active_experts():
    """More experts at the same k add router FLOPs only; a larger k adds expert GEMMs."""
    def moe_flops(spec):
        return compute(spec, _setup(spec)).layers["moe"].flops

    t = 2048
    base, more = moe_flops(_moe()), moe_flops(_moe(experts=16))
    assert more - base == pytest.approx(3 * 2 * t * 8 * 256)  # the router's [16 - 8, 256] rows
    k4 = moe_flops(_moe(experts_per_token=4))
    assert k4 - base == pytest.approx(3 * 2 * t * 2 * 3 * 128 * 256)  # 2 more experts' gate_up and down


@pytest.mark.parametrize("ac,forwards", [("none", 1), ("full", 2)])
def test_all_to_all_traffic_and_host_syncs(ac, forwards):
    spec = _moe()
    p = plan(spec, ParallelConfig(ep=4, activation_checkpointing=ac), micro_batch=2)
    rows = next(c for c in p.time.collectives if c.what == "EP all-to-all tokens")
    t = 2 * 2048
    assert rows.nbytes == t * spec.experts_per_token * spec.hidden * 2 and rows.group.size == 4
    # Dispatch and combine per MoE layer and forward (recomputation too), and their backward.
    assert rows.calls == spec.moe_layers * (2 * forwards + 2) and not rows.overlapped
    eff = p.setup.efficiency
    assert collective_seconds("all_to_all", 1e9, rows.group, p.setup) == pytest.approx(
        eff.latency_us * 1e-6 + 3 / 4 * 1e9 / (450e9 * eff.link))
    assert host_syncs(spec, p.setup) == spec.moe_layers * forwards
    assert p.time.syncs == pytest.approx(host_syncs(spec, p.setup) * eff.host_sync_us * 1e-6)
    assert p.time.step == pytest.approx(p.time.issue_bound + p.time.exposed + p.time.optimizer + p.time.syncs)
    assert p.time.issue_bound >= p.time.compute + p.time.model_parallel  # the all-to-alls on the compute stream
    gathers = {c.what: c.group.name for c in p.time.collectives if c.what.startswith("all-gather")}
    assert gathers == {"all-gather params": "dp_shard", "all-gather experts": "efsdp"}
    dense = plan("1b")
    assert dense.time.syncs == 0 and not [c for c in dense.time.collectives if c.op == "all_to_all"]


def test_fp8_dispatch_sends_a_byte_and_a_scale_per_128_values_of_each_row():
    spec = _moe()
    plain, fp8 = (plan(spec, ParallelConfig(ep=4, fp8_dispatch=f), micro_batch=2) for f in (False, True))
    rows = {c.what: c for c in fp8.time.collectives if c.what.startswith("EP all-to-all tokens")}
    [bf16] = [c for c in plain.time.collectives if c.what == "EP all-to-all tokens"]
    routed = 2 * 2048 * spec.experts_per_token
    dispatch = rows["EP all-to-all tokens, FP8 dispatch"]
    assert dispatch.nbytes == routed * (256 + 4 * 2) and bf16.nbytes == routed * 256 * 2
    # The forward dispatch goes in FP8; the combine and both backward all-to-alls stay bf16.
    assert dispatch.calls == spec.moe_layers and rows["EP all-to-all tokens"].calls == 3 * spec.moe_layers
    assert rows["EP all-to-all tokens"].nbytes == bf16.nbytes and bf16.calls == 4 * spec.moe_layers
    assert fp8.time.model_parallel < plain.time.model_parallel
    with pytest.raises(ValueError, match="fp8_dispatch .* but ep=1 sends none; set ep > 1"):
        ParallelConfig(fp8_dispatch=True)
    with pytest.raises(TypeError, match="fp8_dispatch must be True or False"):
        ParallelConfig(ep=2, fp8_dispatch="yes")


# -- beside tensor parallelism (ep x tp) ---------------------------------------------------------------
@pytest.mark.parametrize("sp", [False, True])
def test_tp_splits_attention_but_not_the_experts(sp):
    """ep 2 x tp 2 on 8 GPUs (dp_shard 4) against ep 2 alone on 4 GPUs (the same dp_shard and
    efsdp): the layer's attention halves, its router and the experts' unit stay whole; what the
    router and experts keep, compute and send per tp rank halves under sequence parallelism (each
    tp rank routes its half of the tokens) and stays whole without (every tp rank routes all)."""
    spec = _moe()
    alone = _setup(spec, world=4, gpus_per_node=4, parallel=ParallelConfig(ep=2))
    beside = _setup(spec, parallel=ParallelConfig(ep=2, tp=2, sequence_parallel=sp))
    assert (beside.parallel.dp_shard, beside.parallel.tp) == (alone.parallel.dp_shard, 2)
    layer1, experts1 = unit_plans(spec, alone)[1:]
    layer2, experts2 = unit_plans(spec, beside)[1:]
    d, q, kv = spec.hidden, spec.q_dim, spec.kv_dim
    attention = 2 * q * d + 2 * kv * d  # wq, wo; wk, wv
    norms_router = 2 * d + spec.experts * d
    assert layer1.local_numel == attention + norms_router
    assert layer2.local_numel == attention // 2 + norms_router
    assert experts2.local_numel == experts1.local_numel == spec.experts // 2 * 3 * spec.expert_ffn * d
    assert (experts2.layout, experts2.chunks) == (experts1.layout, experts1.chunks)
    assert memory_report(spec, beside).main_weights < memory_report(spec, alone).main_weights

    share = 0.5 if sp else 1.0
    # What a MoE layer keeps beyond a dense one: its router's input and routed rows for this tp
    # rank's tokens, less the dense MLP's (w1/w3's input, four F/tp-wide outputs).
    e, f = 2, spec.ffn
    moe, dense = activations(spec, beside, {}, "moe").saved, activations(spec, beside, {}, "dense").saved
    assert moe - dense == pytest.approx(share * (e * d + routed_bytes(spec, beside)) - (e * d + 4 * e * f / 2))

    c1, c2 = compute(spec, alone).layers["moe"], compute(spec, beside).layers["moe"]
    t = 2048
    attn = 3.5 * 2 * t ** 2 * q  # causal attention FLOPs (fwd + bwd), split by tp
    linears = 3 * 2 * t * attention
    moe = 3 * 2 * t * (spec.experts * d + spec.experts_per_token * 3 * spec.expert_ffn * d)
    assert c1.flops == pytest.approx(attn + linears + moe)
    assert c2.flops == pytest.approx(attn / 2 + linears / 2 + share * moe)

    def sent(s):
        return next(c.nbytes for c in plan_setup(spec, s).time.collectives
                    if c.what == "EP all-to-all tokens")

    assert sent(beside) == share * sent(alone) == share * t * spec.experts_per_token * d * 2


def test_expert_groups_follow_the_experts_mesh():
    """make_expert_mesh splits dp_shard into (efsdp, ep), ep inner: on 2 nodes of 8, ep 8 stays in a
    node and efsdp crosses them."""
    spec = model_spec("moe-1b")
    g = groups(_setup(spec, world=16, parallel=ParallelConfig(ep=8)))
    assert (g.ep.size, g.ep.link) == (8, "NVLink")
    assert (g.expert_shard.size, g.expert_shard.link, g.expert_shard.nodes) == (2, "network", 2)
    assert (g.shard.size, g.shard.nodes) == (16, 2)


# -- search and validation -------------------------------------------------------------------------
def test_search_weighs_ep_for_mixtures_of_experts_only():
    found = search("moe-1b", seq_len=2048, global_batch=16)
    eps = {c.parallel.ep for c in found}
    assert eps == {1, 2, 4, 8}
    assert all(c.parallel.dp_shard % c.parallel.ep == 0 for c in found)
    # ep x tp is weighed, but never tp > 1 with ep = 1, which fsdp8.parallelize refuses for experts.
    beside_tp = {(c.parallel.tp, c.parallel.ep) for c in found if c.parallel.tp > 1}
    assert beside_tp and all(ep > 1 for _, ep in beside_tp)
    assert {c.parallel.ep for c in search("1b", seq_len=2048, global_batch=16)} == {1}


@pytest.mark.parametrize("model,layout,message", [
    ("1b", dict(ep=2), "ep=2 splits the experts of a mixture-of-experts model, but 1b is dense; use ep=1"),
    ("moe-1b", dict(ep=3), "ep=3 must divide dp_shard=8"),
    ("moe-1b", dict(ep=4, dp_replicate=4), r"ep=4 must divide dp_shard=2: .* choose ep among \[1, 2\]"),
    # As fsdp8.parallelize: beside tp the experts need ep > 1, borrowed from what tp leaves of dp_shard.
    ("moe-1b", dict(tp=2), r"tp=2 with a mixture-of-experts model and ep=1: .* set ep to a divisor > 1 of "
                           r"dp_shard=4 \(the ranks left beside tp=2\), or use tp=1"),
    ("moe-1b", dict(ep=8, tp=2), r"ep=8 must divide dp_shard=4 \(the ranks left beside tp=2\): .* choose ep among "
                                 r"\[1, 2, 4\], or lower tp"),
])
def test_bad_ep_says_why(model, layout, message):
    with pytest.raises(ValueError, match=message):
        plan(model, ParallelConfig(**layout))


def test_ep_must_split_the_experts_evenly():
    with pytest.raises(ValueError, match=r"ep=4 does not divide the 6 experts of moe; choose ep among \[1, 2\]"):
        plan(_moe(experts=6), ParallelConfig(ep=4))


# -- the command line ----------------------------------------------------------------------------
def test_plan_cli_shows_active_parameters_and_all_to_all(capsys):
    from fsdp8.app import cli

    assert cli.main(["plan", "--model", "moe-1b", "--ep", "4", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "0.91 B params, 0.21 B active per token" in out and "each a mixture of 64 experts of 256 (top 8)" in out
    assert "dp_shard 8 (ep 4 x efsdp 2)" in out and "EP all-to-all tokens" in out
    assert "expert-parallel all-to-all: 3.00 GiB sent per rank and step" in out  # 64 calls of 64 MiB, 3/4 sent
    assert cli.main(["plan", "--model", "moe-1b", "--ep", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["ep"] == 2 and data["model"]["active_params"] == 209224704
    assert cli.main(["plan", "--model", "moe-tiny", "--search", "--top", "3", "--gpus-per-node", "4"]) == 0
    header = capsys.readouterr().out.splitlines()[2]
    assert "R x S x cp x tp ep  strategy" in header
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", "1b", "--ep", "2"])
    assert capsys.readouterr().err.strip() == ("fsdp8 plan: error: ep=2 splits the experts of a mixture-of-experts "
                                               "model, but 1b is dense; use ep=1")


def test_bench_refuses_a_mixture_of_experts_in_one_line(capsys):
    from fsdp8.app import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "--model", "moe-tiny", "--nproc", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fsdp8 bench: error: fsdp8 bench does not run mixture-of-experts")


def test_auto_lays_out_a_mixture_of_experts(capsys):
    import fsdp8

    torch.manual_seed(0)
    model = fsdp8.parallelize(Llama(preset("moe-tiny")), "auto")  # a world of one: ep 1, the planner's pick
    assert model.parallel_config == search("moe-tiny", gpus_per_node=1, top=1)[0].parallel
    assert "fsdp8.parallelize: 'auto' chose dp_replicate 1 x dp_shard 1" in capsys.readouterr().err


@pytest.mark.parametrize("ep", [2, 4])
def test_delayed_experts_histories_are_counted_whole_on_every_rank(ep):
    # Under delayed scaling each expert of each projection keeps a 3 x 1024 fp32 history, all E of
    # them on every ep rank (fsdp8/fp8/grouped_delayed.py), whatever ep is: what the module registers.
    # Its weights gather in bf16, so the experts' unit (its own under ep) holds no other FP8 scales.
    import fsdp8
    from fsdp8.fp8.grouped_delayed import attach

    spec = _moe()
    setup = _setup(spec, parallel=ParallelConfig(ep=ep, fp8=fsdp8.DelayedScaling(),
                                                 precision=Precision(param_dtype=torch.bfloat16)))
    [unit] = [u for u in unit_plans(spec, setup) if u.experts]
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.empty(spec.experts, 2 * spec.expert_ffn, spec.hidden))
    experts.down_proj = torch.nn.Parameter(torch.empty(spec.experts, spec.hidden, spec.expert_ffn))
    attach(experts, fsdp8.DelayedScaling(), ["gate_up_proj", "down_proj"])
    history = sum(b.numel() * 4 for n, b in experts.named_buffers() if n.endswith("amax_history"))
    assert unit.scale_bytes == history == 2 * spec.experts * 3 * 1024 * 4
