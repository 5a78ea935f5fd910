"""The planner's pure parts, without processes: model sizes, activation bytes, links and collective
times, validation, the search's ranking, and `fsdp8 plan` on the command line."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re

import pytest
import torch

import fsdp8
from fsdp8 import ParallelConfig, Precision
from fsdp8.config import Strategy
from fsdp8.fp8.recipes import Recipe
from fsdp8.models.llama import Llama, LlamaConfig, preset
from fsdp8.planner import plan, search
from fsdp8.planner.candidates import fixes
from fsdp8.planner.hardware import GIB, Cluster, Efficiency, gpu_named
from fsdp8.planner.activations import activations
from fsdp8.planner.model import converts_to_fp8, hf_spec, model_spec, tp_piece
from fsdp8.planner.predict import plan_setup
from fsdp8.planner.setup import make_setup
from fsdp8.planner.links import collective_seconds, group, groups

H100 = gpu_named("h100")


def _setup(spec, world=8, gpus_per_node=8, parallel=None, **kw):
    kw.setdefault("seq_len", 16)
    return make_setup(spec, Cluster(H100, world // gpus_per_node, gpus_per_node), parallel, **kw)


# -- the model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,tied", [("tiny", False), ("1b", False), ("8b", False), ("1b", True)])
def test_preset_sizes_match_the_built_in_llama(name, tied):
    with torch.device("meta"):
        model = Llama(preset(name, tie_embeddings=tied))
    spec = model_spec(name, tied=tied)
    assert spec.num_params == model.num_params()
    assert spec.flops_per_token(2048) == model.flops_per_token(2048)


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32}),
                                        ("mistral", {"tie_word_embeddings": True})])
def test_hf_config_json_gives_the_model_transformers_builds(tmp_path, kind, extra):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(kind, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=99, **extra)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = model_spec(f"hf:{tmp_path}")
    assert spec.family == "hf" and spec.num_params == sum(p.numel() for p in model.parameters())


def test_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_spec(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not a Llama-family decoder"):
        hf_spec(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="config.json has no 'num_hidden_layers', 'intermediate_size', "
                                         "'num_attention_heads', 'vocab_size'$"):
        hf_spec(str(tmp_path))


LLAMA_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "vocab_size": 99}


@pytest.mark.parametrize("text,problem", [
    ('{"model_type": "llama", "hidden_size": 64,,}',
     " is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 43"),
    ("", " is empty"),
    ("[1, 2]", " holds a JSON array, not an object of config fields"),
    (json.dumps({"hidden_size": 64}), " has no 'model_type'"),
    (json.dumps(dict(LLAMA_CONFIG, hidden_size="64")), ": hidden_size is '64', not a positive integer"),
    (json.dumps(dict(LLAMA_CONFIG, num_key_value_heads=0)), ": num_key_value_heads is 0, not a positive integer"),
])
def test_a_malformed_config_json_is_named_with_its_problem(tmp_path, capsys, text, problem):
    from fsdp8.app import cli

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", f"hf:{tmp_path}"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"fsdp8 plan: error: {tmp_path / 'config.json'}{problem[0]}"), err
    assert problem in err[0]


def test_sizes_by_flag_and_their_errors():
    spec = model_spec(None, layers=2, hidden=64, ffn=128, heads=4, vocab=100)
    assert (spec.kv_heads, spec.hd) == (4, 16)
    assert model_spec("tiny", layers=8).layers == 8
    with pytest.raises(ValueError, match="--ffn, --vocab missing"):
        model_spec(None, layers=2, hidden=64, heads=4)
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        model_spec("huge")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        model_spec("tiny", kv_heads=3)


def test_tensor_parallel_pieces_and_fp8_conversion():
    assert [tp_piece(37, 2, r) for r in (0, 1)] == [19, 18]
    assert [tp_piece(5, 4, r) for r in range(4)] == [2, 2, 1, 0]
    spec = model_spec(None, layers=1, hidden=64, ffn=96, heads=4, kv_heads=2, vocab=37)
    wk, w1 = [p for p in spec.block_params() if p.name in ("wk", "w1")]
    assert converts_to_fp8(wk, "current", 2, 0)  # a 16 x 64 piece
    assert not converts_to_fp8(wk, "mxfp8", 2, 0)  # 16 rows cut a 32-wide MX block
    assert not converts_to_fp8(w1, "block", 2, 0)  # 48 rows cut a 128 x 128 block
    assert not converts_to_fp8(spec.root_params()[0], "current", 1, 0)  # outside the units


# -- activations -------------------------------------------------------------------------------
def saved_by_first_block(cfg: LlamaConfig, compiled: bool = False) -> dict:
    """The storages autograd saves in a forward of the built-in Llama's first block of ``cfg`` on
    a batch of 2 x 16 tokens, by address: their bytes (parameters, buffers and the rotary tables
    excluded). ``compiled``: the block under torch.compile (Inductor), measured on its second
    call, after it was compiled."""
    torch.manual_seed(0)
    model = Llama(cfg)
    cos, sin = model.rotary(16, torch.float32)
    fixed = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers()) + [cos, sin]}
    block = torch.compile(model.layers[0]) if compiled else model.layers[0]
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in fixed:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if compiled:
        block(torch.randn(2, 16, cfg.dim, requires_grad=True), cos, sin).sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(torch.randn(2, 16, cfg.dim, requires_grad=True), cos, sin)
    return saved


def test_activation_formula_counts_what_autograd_saves():
    """One built-in Llama block in fp32 on the CPU: the bytes of every tensor autograd saves
    (parameters and the rotary tables excluded) against the formula for AC none."""
    cfg = LlamaConfig(vocab_size=37, dim=48, n_layers=1, n_heads=3, n_kv_heads=1, ffn_dim=80, max_seq_len=16)
    saved = saved_by_first_block(cfg)
    spec = model_spec(None, layers=1, hidden=48, ffn=80, heads=3, kv_heads=1, vocab=37)
    fp32 = ParallelConfig(precision=Precision())
    per_token = activations(spec, _setup(spec, world=1, gpus_per_node=1, parallel=fp32, micro_batch=2), {}).saved
    # On the CPU, SDPA's output is head-major, so wo's input is a copy (on CUDA it is a view).
    cpu_copy = 4 * spec.q_dim
    assert sum(saved.values()) == (per_token + cpu_copy) * 2 * 16


@pytest.mark.parametrize("dim, ffn, heads, kv_heads", [(48, 80, 3, 1), (64, 160, 4, 2)])
def test_compiled_activation_formula_counts_what_inductor_saves(dim, ffn, heads, kv_heads):
    """The same block compiled: Inductor's partitioner keeps each norm's input and rsqrt, not its
    fp32 copies, and recomputes SiLU (activations.py [Note: what a compiled layer keeps]); the
    bytes it saves against the compiled formula, which is below the eager one."""
    cfg = LlamaConfig(vocab_size=37, dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn,
                      max_seq_len=16)
    saved = saved_by_first_block(cfg, compiled=True)
    spec = model_spec(None, layers=1, hidden=dim, ffn=ffn, heads=heads, kv_heads=kv_heads, vocab=37)
    per_token = {}
    for compiled in (False, True):
        layout = ParallelConfig(precision=Precision(), compile=compiled)
        per_token[compiled] = activations(spec, _setup(spec, world=1, gpus_per_node=1, parallel=layout,
                                                       micro_batch=2), {}).saved
    cpu_copy = 4 * spec.q_dim  # as in the eager test above
    assert sum(saved.values()) == (per_token[True] + cpu_copy) * 2 * 16
    # fp32: each norm's two fp32 copies (8 dn) become its input (4 dn); SiLU's output (4 f) is recomputed.
    assert per_token[True] == per_token[False] - 2 * 4 * dim - 4 * ffn


def test_checkpointing_keeps_less():
    spec = model_spec("8b")
    kept = {ac: activations(spec, _setup(spec, parallel=ParallelConfig(activation_checkpointing=ac)), {}).saved
            for ac in ("none", "selective", "full")}
    assert kept["full"] == 2 * spec.hidden < kept["selective"] < kept["none"]


# -- links and collectives ---------------------------------------------------------------------
def test_groups_follow_the_mesh_order():
    spec = model_spec("8b")
    g = groups(_setup(spec, world=32, parallel=ParallelConfig(dp_replicate=2, tp=4)))
    assert (g.tp.link, g.tp.size) == ("NVLink", 4)
    assert (g.shard.link, g.shard.nodes, g.shard.per_node) == ("network", 2, 2)  # 4 ranks, 4 apart
    assert (g.replicate.link, g.replicate.nodes, g.replicate.per_node) == ("network", 2, 1)
    assert group("x", 8, 1, 8).link == "NVLink" and group("x", 1, 1, 8).link == "local"


def test_collective_seconds():
    spec = model_spec("tiny")
    setup = _setup(spec, world=16)
    eff = setup.efficiency
    inside = collective_seconds("all_gather", 1e9, group("g", 8, 1, 8), setup)
    assert inside == pytest.approx(eff.latency_us * 1e-6 + 7 / 8 * 1e9 / (450e9 * eff.link))
    across = collective_seconds("all_reduce", 1e9, group("g", 2, 8, 8), setup)  # one GPU per node
    assert across == pytest.approx(eff.latency_us * 1e-6 + 2 * 1 / 2 * 1e9 / (50e9 * eff.link))
    assert collective_seconds("all_gather", 1e9, group("g", 1, 1, 8), setup) == 0.0


# -- plans ---------------------------------------------------------------------------------------
def test_more_sharding_less_memory_and_the_exact_rows():
    totals = [plan("1b", ParallelConfig(strategy=s)).memory.report.persistent for s in fsdp8.config.STRATEGY_NAMES]
    assert totals == sorted(totals, reverse=True) and totals[0] > 3 * totals[-1]
    p = plan("1b")
    assert p.memory.report.main_weights == p.memory.report.grads  # every parameter trainable, fp32
    assert p.memory.optimizer == pytest.approx(2 * p.memory.report.main_weights, rel=1e-3)


def test_step_time_parts_and_throughput():
    selective = ParallelConfig(activation_checkpointing="selective")
    p = plan("8b", selective, nodes=4, seq_len=4096, micro_batch=2, global_batch=128)
    t = p.time
    assert t.step == pytest.approx(t.compute + t.model_parallel + t.exposed + t.optimizer)
    assert p.setup.accumulation == 2
    assert p.tokens_per_s_per_gpu == pytest.approx(128 * 4096 / (t.step * 32))
    assert 0.2 < p.mfu < 0.7
    tp = plan("8b", ParallelConfig(tp=8, activation_checkpointing="selective"), nodes=4, seq_len=4096, micro_batch=2,
              global_batch=128)
    assert tp.time.model_parallel > 0 and t.model_parallel == 0
    whats = {c.what for c in tp.time.collectives}
    assert {"TP all-reduce activations", "all-gather params", "reduce-scatter grads"} <= whats


@pytest.mark.parametrize("sequence_parallel,ac,compiled,per_layer", [
    (True, "none", False, 9), (False, "none", False, 7), (True, "full", False, 13),
    (True, "none", True, 7), (True, "full", True, 9)])
def test_fp8_current_scaling_under_tp_counts_its_amax_agreements(sequence_parallel, ac, compiled, per_layer):
    # Per layer: forward agrees o_proj's and down's feature-split inputs (and, in eager layers under
    # sequence parallelism, the two inputs gathered as FP8 bytes; compiled layers gather them in
    # high precision), backward the 5 column-parallel output gradients; full recomputation repeats
    # the forward's. Delayed scaling agrees nothing per GEMM.
    def agreements(recipe):
        config = ParallelConfig(tp=2, sequence_parallel=sequence_parallel, activation_checkpointing=ac, fp8=recipe,
                                compile=compiled)
        p = plan("1b", config, gpus_per_node=2, seq_len=2048)
        return [c for c in p.time.collectives if c.what == "TP FP8 amax agreements"], p.spec.layers

    rows, layers = agreements(fsdp8.Float8CurrentScaling())
    assert [(r.op, r.calls, r.nbytes) for r in rows] == [("all_reduce", per_layer * layers, 4)]
    assert agreements(fsdp8.DelayedScaling())[0] == []


@pytest.mark.parametrize("compiled,recipe,width", [(False, "current", 1), (True, "current", 2), (True, "delayed", 1),
                                                   (False, "block", 2)])
def test_sequence_gather_bytes_follow_where_fp8_layers_quantize(compiled, recipe, width):
    # Eager per-tensor FP8 layers (and delayed scaling, an opaque call when compiled) gather the
    # sequence as FP8 bytes; compiled current scaling and block scaling gather it in bf16.
    recipes = {"current": fsdp8.Float8CurrentScaling(), "delayed": fsdp8.DelayedScaling(),
               "block": fsdp8.Float8BlockScaling()}
    config = ParallelConfig(tp=2, sequence_parallel=True, fp8=recipes[recipe], compile=compiled)
    p = plan("1b", config, gpus_per_node=2, seq_len=2048, micro_batch=1)
    [gather] = [c for c in p.time.collectives if c.what == "TP all-gather activations"]
    assert gather.nbytes == 2048 * p.spec.hidden * width


def test_faster_links_expose_less():
    slow = plan("8b", nodes=8, seq_len=1024, gpu=gpu_named("h100", network_gbps=5.0))
    fast = plan("8b", nodes=8, seq_len=1024)
    assert slow.time.exposed > 2 * fast.time.exposed and slow.time.compute == fast.time.compute


class _E5M2(Recipe):
    name = "e5m2"  # a recipe the planner does not know


@pytest.mark.parametrize("layout,kwargs,message", [
    (dict(tp=3), {}, "dp_replicate 1 x cp 1 x tp 3 = 3 does not divide the 8 ranks"),
    (dict(tp=8), dict(model="tiny"), "tp=8 does not divide heads=4, kv_heads=2 of tiny; use tp in (1, 2)"),
    ({}, dict(global_batch=12), "global batch 12 is not a multiple of micro batch 1 x 8 data-parallel ranks"),
    (dict(cp=2), dict(seq_len=6), "seq_len 6 is not a multiple of 2 x cp = 4"),
    (dict(dp_shard=4), {}, "dp_replicate 1 x dp_shard 4 x cp 1 x tp 1 = 4, but the world has 8 ranks"),
    # What ParallelConfig refuses itself, as it says it (a NotImplementedError is a ValueError there too).
    (dict(cp=2, activation_checkpointing="selective"), {}, "use activation_checkpointing='full' with cp > 1"),
    (dict(outer_strategy="optim"), {}, "dp_replicate=1 makes none"),
    (dict(fp8=fsdp8.Float8CurrentScaling(), offload="optim"), {}, "offload 'optim' with FP8 layers is not supported"),
    (dict(fp8=fsdp8.Float8CurrentScaling(), precision=Precision()), {}, "FP8 layers compute in bf16"),
    (dict(fp8=_E5M2()), {}, "fp8 recipe 'e5m2'"),
    (dict(offload="optim", strategy="no_shard"), {}, "use strategy='optim' or higher"),
    (dict(activation_checkpointing="some"), {}, "activation_checkpointing='some': use one of"),
    ({}, dict(gpu="a100"), "unknown GPU 'a100'"),
])
def test_impossible_configurations_say_why(layout, kwargs, message):
    kwargs = dict(kwargs)
    model = kwargs.pop("model", "1b")
    with pytest.raises(ValueError) as e:
        plan(model, ParallelConfig(**layout), **kwargs)
    assert message in str(e.value)


# -- search ------------------------------------------------------------------------------------
def test_search_ranks_what_fits_fastest_first():
    found = search("1b", seq_len=2048, global_batch=16)
    speeds = [c.tokens_per_s_per_gpu for c in found]
    assert speeds == sorted(speeds, reverse=True) and all(c.plan.memory.fits for c in found)
    best = found[0]
    # A 1 B model fits on one H100 without recomputation or model parallelism: the winner
    # needs neither, and recomputation only slows the same layout down.
    config = best.parallel
    assert (config.tp, config.activation_checkpointing, config.offload) == (1, "none", None)
    fastest = {}  # the fastest of each checkpointing mode at the winner's tp, offload and micro-batch
    for c in found:
        if (c.parallel.tp, c.parallel.offload, c.micro_batch) == (config.tp, config.offload, best.micro_batch):
            fastest.setdefault(c.parallel.activation_checkpointing, c.tokens_per_s_per_gpu)
    assert fastest["none"] > max(fastest["selective"], fastest["full"])
    # Ready for parallelize: every mesh size known, precision left to it (bf16 on GPUs).
    assert (config.dp_shard, config.precision, config.fp8) == (8, None, None)
    assert fsdp8.planner.search is search and len(search("1b", global_batch=16, top=3)) == 3


def test_search_shows_one_of_configurations_that_differ_only_in_data_parallel_sharding():
    """1 x 8 ZeRO-2 and the HSDP meshes 2 x 4, 4 x 2, 8 x 1 sharding the optimizer across replicas
    predict the same speed: the top shows the first (the least memory, the fewest replicas)."""
    def layout(c):
        p = c.parallel
        return p.cp, p.tp, p.sequence_parallel, p.activation_checkpointing, p.offload, c.micro_batch

    found = search("1b", top=5)
    pairs = [(a, b) for a, b in itertools.combinations(found, 2) if layout(a) == layout(b)
             and a.tokens_per_s_per_gpu == pytest.approx(b.tokens_per_s_per_gpu, rel=1e-9)]
    assert pairs == [], [(a.plan.setup.describe(), b.plan.setup.describe()) for a, b in pairs]
    assert (found[0].parallel.dp_replicate, found[0].parallel.strategy) == (1, Strategy.OPTIM_GRADS)


def test_a_model_that_fits_nowhere_says_what_would():
    with pytest.raises(ValueError, match=r"nothing fits: .* needs 24.4 GiB per GPU of 16; it fits on 4 nodes of 8 "
                                         r"\(--nodes 4\)"):
        search("8b", gpu=gpu_named("h100", memory_gib=16.0), seq_len=2048, global_batch=8, tps=(1,), offloads=(None,))
    with pytest.raises(ValueError, match="does not fit on 4096 nodes either"):
        search(None, layers=1, hidden=1024, ffn=1024, heads=8, vocab=128000, seq_len=2 ** 20, global_batch=8)


def test_fixes_name_flags_that_make_it_fit():
    p = plan("8b", ParallelConfig(strategy="optim"), gpus_per_node=8, seq_len=8192, micro_batch=4)
    assert not p.memory.fits
    found = fixes(p)
    assert found and all(s.startswith("--") for s in found)
    flags = found[0].split(" (")[0].split()
    changed = dict(zip(flags[::2], flags[1::2]))
    kwargs = {k[2:].replace("-", "_"): (int(v) if v.isdigit() else v) for k, v in changed.items()}
    kwargs["activation_checkpointing"] = kwargs.pop("ac", "none")
    micro_batch = kwargs.pop("micro_batch", 4)
    layout = ParallelConfig(**dict(dict(strategy="optim"), **kwargs))
    assert plan("8b", layout, seq_len=8192, micro_batch=micro_batch, global_batch=32).memory.fits


@pytest.mark.parametrize("layout,kwargs,expected", [
    ({}, dict(gpus_per_node=1), ["--offload optim"]),  # once, not again beside settings already in effect
    (dict(strategy="no_shard"), dict(gpus_per_node=8), None),
    (dict(strategy="optim"), dict(gpus_per_node=8, seq_len=8192, micro_batch=4), None),
    (dict(strategy="no_shard", tp=2, sequence_parallel=True), dict(gpus_per_node=8, seq_len=16384), None),
])
def test_fixes_are_distinct_changes_of_settings_not_in_effect(layout, kwargs, expected):
    p = plan("8b", ParallelConfig(**layout), **kwargs)
    found = [fix.split(" (")[0] for fix in fixes(p)]
    assert found and (expected is None or found == expected), found
    s = p.setup.parallel
    current = {"--strategy": s.strategy.label, "--ac": s.activation_checkpointing,
               "--micro-batch": str(p.setup.micro_batch), "--tp": str(s.tp),
               "--sequence-parallel": s.sequence_parallel, "--offload": s.offload}
    changes = [set(re.findall(r"(--[a-z-]+)(?: ([^-]\S*))?", fix)) for fix in found]
    for change in changes:
        assert all(current[flag] != (value or True) for flag, value in change), (change, current)
    # Each is needed whole: no suggestion holds another one.
    assert all(not a <= b for a, b in itertools.permutations(changes, 2)), found


def _layer_parts(spec, parallel, **kw):
    """One dense layer's activation bytes per token, GPU seconds and host seconds under ``parallel``."""
    from fsdp8.planner.compute import compute

    setup = _setup(spec, world=kw.pop("world", 8), parallel=parallel, **kw)
    layer = compute(spec, setup).layers["dense"]
    fp8 = {p.name: converts_to_fp8(p, setup.fp8, setup.parallel.tp, 0) for p in spec.block_params()}
    return activations(spec, setup, fp8).saved, layer.fwd + layer.bwd, layer.host_fwd + layer.host_bwd


@pytest.mark.parametrize("recipe", [None, fsdp8.Float8CurrentScaling()])
def test_compiled_layer_time_and_host_follow_the_fused_counts(recipe):
    # The compiled layer's GPU time differs from eager's only by the elementwise bytes Inductor
    # fuses away (norms with the residual adds, rotary, SwiGLU; PLANNING.md "Compiled layers" has
    # the per-layer runs these counts were checked against), and its host issues fused kernels,
    # traced FP8 linears two each, with none of the eager FP8 linear's Python.
    spec = model_spec("8b")
    eager = _layer_parts(spec, ParallelConfig(fp8=recipe), seq_len=2048, micro_batch=1)
    compiled = _layer_parts(spec, ParallelConfig(fp8=recipe, compile=True), seq_len=2048, micro_batch=1)
    gpu = gpu_named("h100")
    e, d, q, kv, f = 2, spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn
    eager_bytes = 2 * (32 + 2 * e) * d + 9 * e * (q + kv) + 2 * e * (kv + q) + 6 * e * d + 5 * e * f
    compiled_bytes = 8 * e * d + 2 * e * (q + kv) + 2 * e * (kv + q) + 3 * e * f
    hbm = gpu.hbm_gbps * 1e9 * Efficiency().hbm
    # forward once, backward twice: 3 passes over 2048 tokens
    assert eager[1] - compiled[1] == pytest.approx(3 * (eager_bytes - compiled_bytes) * 2048 / hbm)
    # The host: Inductor's fused kernels (and each traced FP8 linear's two) per pass, the engine's
    # own ops per unit; an eager FP8 linear's Python on top of eager's op count.
    from fsdp8.planner.hardware import COMPILED_LAYER_OPS, ENGINE_OPS, LAYER_OPS, TRACED_FP8_OPS

    op, linears = Efficiency().host_op_us * 1e-6, 7 if recipe else 0
    assert compiled[2] == pytest.approx((3 * (COMPILED_LAYER_OPS + TRACED_FP8_OPS * linears) + 2 * ENGINE_OPS) * op)
    assert eager[2] == pytest.approx((3 * LAYER_OPS + 2 * ENGINE_OPS) * op + linears * Efficiency().fp8_linear_host_ms * 1e-3)


def test_which_compiled_fp8_linears_are_traced():
    from fsdp8.planner.model import traces_fp8

    current, delayed = fsdp8.Float8CurrentScaling(), fsdp8.DelayedScaling()
    assert traces_fp8(ParallelConfig(fp8=current, compile=True, tp=2))
    assert traces_fp8(ParallelConfig(fp8=delayed, compile=True))  # the engine updates its states outside
    assert not traces_fp8(ParallelConfig(fp8=delayed, compile={}, tp=2))  # an opaque call under TP; {} compiles
    assert not traces_fp8(ParallelConfig(fp8=current, tp=2))  # eager
    assert not traces_fp8(ParallelConfig(compile=True))


def test_compiled_fp8_layers_keep_their_inputs_not_fp8_copies():
    """activations.py [Note: what a compiled layer keeps]: traced FP8 linears keep the block's own
    tensors, and the norms' outputs go into the backward's quantization; delayed scaling under TP
    is an opaque call in compiled layers and keeps its FP8 copies as eagerly."""
    spec = model_spec("8b")
    e, dn, kv = 2, spec.hidden / 2, spec.kv_dim / 2
    tp = dict(tp=2, sequence_parallel=True)
    bf16 = _layer_parts(spec, ParallelConfig(compile=True, **tp), seq_len=2048, micro_batch=1)[0]
    current = _layer_parts(spec, ParallelConfig(compile=True, fp8=fsdp8.Float8CurrentScaling(), **tp),
                           seq_len=2048, micro_batch=1)[0]
    assert current == bf16 - (2 * e * dn - kv)
    delayed = ParallelConfig(fp8=fsdp8.DelayedScaling(), **tp)
    eager_delayed = _layer_parts(spec, delayed, seq_len=2048, micro_batch=1)[0]
    compiled_delayed = _layer_parts(spec, dataclasses.replace(delayed, compile=True), seq_len=2048, micro_batch=1)[0]
    # eager and compiled keep the same FP8 bytes; compiled only the norms' and SiLU's savings
    assert eager_delayed - compiled_delayed == 2 * (8 - e) * dn + e * spec.ffn / 2  # fsdp8 norms keep 8 dn eagerly


def test_efficiency_is_the_stated_fraction():
    base = plan("1b")
    half = plan("1b", efficiency=Efficiency(gemm=0.35))
    assert half.time.compute > 1.3 * base.time.compute
    assert (half.time.exposed, half.time.optimizer) == (base.time.exposed, base.time.optimizer)
    with pytest.raises(ValueError, match="Efficiency.gemm=1.5 is out of range"):
        Efficiency(gemm=1.5)


# -- the command line --------------------------------------------------------------------------
def test_plan_cli_table_json_and_search(capsys):
    from fsdp8.app import cli

    assert cli.main(["plan", "--model", "8b", "--nodes", "2", "--tp", "2", "--seq-len", "4096", "--ac", "selective"]) == 0
    out = capsys.readouterr().out
    assert "persistent, exact (what memory_report() says)" in out and "TP all-reduce activations" in out
    assert "tokens/s/GPU" in out
    assert cli.main(["plan", "--layers", "4", "--hidden", "256", "--ffn", "512", "--heads", "4", "--vocab", "1000",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["fits"] and data["model"]["layers"] == 4 and data["tokens_per_s_per_gpu"] > 0
    assert data["setup"]["compile"] is False
    assert cli.main(["plan", "--layers", "4", "--hidden", "256", "--ffn", "512", "--heads", "4", "--vocab", "1000",
                     "--json", "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["setup"]["compile"] is True
    assert compiled["memory"]["peak_allocated"] < data["memory"]["peak_allocated"]
    assert cli.main(["plan", "--model", "1b", "--search", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fsdp8 plan --search") and len(out) == 5
    # --search --cp N weighs every cp dividing N (a 64k sequence: only cp > 1 fits a 16 GiB GPU)
    argv = ["plan", "--model", "1b", "--seq-len", "65536", "--gpu-memory", "16", "--search", "--json", "--top", "50"]
    assert cli.main(argv + ["--cp", "4"]) == 0
    cps = {c["setup"]["cp"] for c in json.loads(capsys.readouterr().out)}
    assert cps and cps <= {2, 4} and 1 not in cps, cps


def test_plan_cli_does_not_fit_and_errors(capsys):
    from fsdp8.app import cli

    assert cli.main(["plan", "--model", "8b", "--seq-len", "8192", "--micro-batch", "4", "--strategy", "optim"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "would fit with: --" in out
    for argv, message in ((["--model", "1b", "--tp", "3"], "does not divide the 8 ranks"),
                          (["--layers", "2"], "--hidden, --ffn, --heads, --vocab missing"),
                          (["--model", "hf:/nonexistent"], "no config.json")):
        with pytest.raises(SystemExit):
            cli.main(["plan", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fsdp8 plan: error: ") and message in err[0], err


def test_memory_numbers_are_bytes():
    p = plan("tiny", gpus_per_node=1)
    assert isinstance(p.memory.report.main_weights, int) and p.memory.capacity == math.floor(79.1 * GIB)
    assert plan_setup(p.spec, p.setup).memory.total == p.memory.total


def test_a_loopback_world_is_predicted_without_communication():
    """fsdp8.app.bench.bench.without_network: what a loopback world of 2 on one GPU is predicted to take
    is the same work with every collective free (and nothing else changed)."""
    from fsdp8.app.bench.bench import without_network

    spec = model_spec("1b")
    cluster = Cluster(H100, 1, 2)
    tp = ParallelConfig(tp=2)
    real = plan_setup(spec, make_setup(spec, cluster, tp, seq_len=2048, micro_batch=2))
    cluster_free, eff_free = without_network(cluster, Efficiency())
    free = plan_setup(spec, make_setup(spec, cluster_free, tp, seq_len=2048, micro_batch=2, efficiency=eff_free))
    assert real.time.model_parallel > 0
    assert free.time.model_parallel < 1e-6 and free.time.exposed < 1e-6
    assert free.time.compute == real.time.compute and free.memory.allocated == real.memory.allocated
    assert free.time.step < real.time.step


@pytest.mark.parametrize("tied", [False, True])
def test_backward_holds_the_heads_gradient_and_the_embeddings_only_at_the_end(tied):
    """Gradients of the root unit while the layers run backward: the head's and the final
    norm's (the loss's backward made them), not an untied embedding's, which autograd makes
    only when backward reaches the input (measured: model B at world 1 and a loopback world
    of 2 on an H200 peaked 0.24 GiB, one embedding gradient, below the count with it)."""
    from fsdp8.planner.memory import memory_report, peaks, unit_plans

    spec = model_spec("1b", tied=tied)
    setup = _setup(spec, world=2, gpus_per_node=2, seq_len=2048)
    units = unit_plans(spec, setup)
    moments = {p.moment: p.parts["gradient transients"]
               for p in peaks(spec, setup, memory_report(spec, setup), units, activations(spec, setup, {}))}
    root, layer = units
    head_and_norm = spec.vocab * spec.hidden + spec.hidden  # tied: the one matrix is the head's too
    assert root.local_numel == head_and_norm + (0 if tied else spec.vocab * spec.hidden)
    assert moments["backward of the last layer"] == (head_and_norm + layer.local_numel) * 2


def test_search_weighs_context_parallelism_but_not_with_selective_checkpointing():
    found = search("1b", gpus_per_node=4, seq_len=16384, cps=(1, 2, 4), tps=(1,))
    assert {c.parallel.cp for c in found} == {1, 2, 4}
    assert not [c for c in found if c.parallel.cp > 1 and c.parallel.activation_checkpointing == "selective"]


@pytest.mark.parametrize("strategy,freed", [("optim_grads_params", True), ("optim_grads", False)])
def test_mx_scale_inv_lives_with_the_unsharded_parameters_under_zero3(strategy, freed):
    """Float8Unit frees MX's scale_inv with the unsharded weights (ZeRO-3): the plan counts it
    in the unit buffers in flight, not among the persistent FP8 scales; under ZeRO-2 the unsharded
    weights, and it, stay."""
    from fsdp8.planner.memory import memory_report, peaks, unit_plans

    spec = model_spec("1b")
    setup = _setup(spec, parallel=ParallelConfig(fp8=fsdp8.MXFP8BlockScaling(), strategy=strategy))
    layer = unit_plans(spec, setup)[1]
    fp8 = {p.name: converts_to_fp8(p, "mxfp8", 1, 0) for p in spec.block_params()}
    # One fp32 scale_inv per 32 elements of a row, each weight's padded to 4 floats.
    shapes = [p.shape for p in spec.block_params() if fp8[p.name]]
    expected = sum(4 * 4 * math.ceil(rows * math.ceil(cols / 32) / 4) for rows, cols in shapes)
    assert layer.scale_bytes + layer.gathered_scale_bytes == expected > 0
    assert (layer.gathered_scale_bytes, layer.scale_bytes) == ((expected, 0) if freed else (0, expected))
    moments = peaks(spec, setup, memory_report(spec, setup), unit_plans(spec, setup),
                    activations(spec, setup, fp8))
    first = moments[0].parts
    assert first["FP8 scales"] == (0 if freed else spec.layers * expected)
    if freed:  # the layer in use and the one prefetched, each with its scale_inv
        assert first["unit buffers in flight"] >= 2 * (layer.unsharded_bytes + expected)
