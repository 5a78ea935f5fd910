"""fsdp8.parallelize against one process (gloo, 4 ranks): built-in Llama and Hugging Face families, every AC mode.

Tolerances, derived:
- fp32 (FP32_TOL, gradients and weights after SGD steps): measured in one process against
  the same model in float64, a fp32 run's gradients are within 1.8e-6 relative (worst:
  Gemma 3's norms and q_proj at the second step; Llama families 8e-7, the built-in Llama
  6.5e-7: small differences of large terms). The parallel run and the reference are two
  such runs with differently ordered sums (tp-split GEMM reductions, data-parallel means,
  sequence-parallel norms), so they may differ by twice that: 4e-6. SGD is linear in the
  gradients, so the weights stay as close. The loss is one reduction: within 1e-6.
- FP8 current scaling (FP8_TOL): with scales agreed over tp and weights equal before each
  step (lockstep), every FP8 byte and scale equals the single process's; in fp64 compute
  (tests/dist/common.FP8_PARITY_PRECISION says why) the GEMMs are emulated exactly and what
  differs is the order of the fp64 sums around them and the fp32 main weights' steps; 1e-5.
- Activation checkpointing recomputes the same ops on the same values: the same errors as
  without it (bit-identical on CPUs), so the same bounds.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

import fsdp8
from fsdp8.parallel.checkpointing import _full_compiled_policy, _selective_policy, checkpoint_units
from tests.dist import parallelize_workers as workers
from tests.harness import BACKEND, retire_pool, run_on_ranks

FP32_TOL = 4e-6
LOSS_TOL = 1e-6
FP8_TOL = 1e-5
DP2_TP2, DP4, DP2_CP2, TP2_CP2 = {"tp": 2}, {}, {"cp": 2}, {"tp": 2, "cp": 2}
HAS_OFFLOAD = "offload" in inspect.signature(fsdp8.fully_shard).parameters


def _check(results, group: int, variant=lambda name: name):
    """Every run of every rank within the bounds; what AC must and must not change.
    ``group``: cp x tp, the neighbouring ranks fed the same rows; ``variant(name)``: the
    VARIANTS entry of the run called ``name``."""
    for rank, out in enumerate(results):
        for name, got in out.items():
            errors = got["errors"]
            assert errors["loss"] <= LOSS_TOL and errors["grad"] <= FP32_TOL and errors["weight"] <= FP32_TOL, (
                name, errors)
            assert got["tied"] and got["class"].startswith("Sharded"), (name, got)
            assert got["dp"] == (rank // group, len(results) // group), (name, got["dp"])
            checkpointed = workers.VARIANTS[variant(name)].get("activation_checkpointing", "none") != "none"
            assert got["layer_calls"] == (2 if checkpointed else 1), (name, got["layer_calls"])
        # Recomputation gathers nothing: each unit's all-gathers equal those without AC.
        gathers = {name: got["gathers"] for name, got in out.items()}
        assert len({str(sorted(g.items())) for g in gathers.values()}) == 1, gathers


PARITY = [
    ("builtin", DP2_TP2, ["plain", "full", "selective", "sp"]),
    ("builtin", DP4, ["plain", "selective"] + (["offload"] if HAS_OFFLOAD else [])),
    ("llama", DP2_TP2, ["plain", "full", "selective", "sp"]),
    ("llama", DP4, ["plain", "full"]),
    ("qwen2", DP2_TP2, ["plain", "full", "sp"]),  # tied embedding and head
    ("qwen2", DP4, ["selective"]),
    ("builtin", DP2_CP2, ["plain", "full"]),  # context parallel: sequence chunks, K/V gathered
    ("llama", TP2_CP2, ["sp_full"]),  # selective is refused with cp (see test_parallel_config)
]
LAYOUT_NAMES = {(): "dp4", ("tp",): "dp2xtp2", ("cp",): "dp2xcp2", ("cp", "tp"): "tp2xcp2"}


@pytest.mark.parametrize("family,layout,variants", PARITY,
                         ids=[f"{f}-{LAYOUT_NAMES[tuple(sorted(l))]}" for f, l, _ in PARITY])
def test_parity(family, layout, variants):
    if family != "builtin":
        pytest.importorskip("transformers")
    results = run_on_ranks(4, workers.parity, family, layout, variants)
    _check(results, layout.get("tp", 1) * layout.get("cp", 1))
    if "offload" in variants:
        assert all(out["offload"]["offloaded"] in (True, None) for out in results)


def test_hf_families_sequence_parallel_selective():
    # Mistral, Qwen3 and Gemma 3 (per-head q/k norms, replicated with partial gradients),
    # Gemma 2 (eager attention, soft-capping), Phi-3 (fused projections, gathered outputs).
    # A family whose plan the installed transformers does not lay out on its modules (4.57's
    # Gemma3ForCausalLM names a base model it does not have) must get the error naming tp_plan.
    transformers = pytest.importorskip("transformers")
    results = run_on_ranks(4, workers.families, ["mistral", "qwen3", "gemma2", "gemma3", "phi3"])
    no_plan = {family: out.pop("no plan") for family, out in list(results[0].items()) if "no plan" in out}
    for message in no_plan.values():
        assert "no automatic tensor-parallel plan" in message and "ParallelConfig(tp_plan=" in message, message
    worked = set(results[0]) - set(no_plan)
    required = {"mistral", "qwen3", "phi3"}
    if int(transformers.__version__.split(".")[0]) >= 5:
        required |= {"gemma2", "gemma3"}
    assert worked >= required, (sorted(worked), no_plan)
    _check([{f: out[f] for f in worked} for out in results], 2, variant=lambda family: "sp")


@pytest.mark.parametrize("family,sequence_parallel,checkpointing,compiled", [
    ("builtin", False, "none", False),
    ("llama", True, "selective", False),
    # Compiled: each FP8 linear is traced into the layer's graph (tp_forward.py [Note: FP8 under
    # TP, compiled]), the sequence gathered by DTensor and the scales agreed in the graph.
    ("llama", True, "none", True),
])
def test_fp8_current_scaling_with_tp(family, sequence_parallel, checkpointing, compiled):
    if family != "builtin":
        pytest.importorskip("transformers")
    for worst, converted in run_on_ranks(4, workers.fp8_parity, family, sequence_parallel, checkpointing, compiled):
        assert len(converted) == 14, converted  # every projection of both layers runs in FP8
        assert worst["loss"] <= FP8_TOL and worst["grad"] <= FP8_TOL, worst


def test_sequence_parallel_gathers_each_input_once():
    # A Llama layer's q/k/v read one sequence-sharded input and gate/up another: each is
    # gathered once, not once per projection. With FP8 (current scaling) it is quantized (one
    # amax agreement), gathered as FP8 bytes and its gradient reduce-scattered once: on two
    # layers 4, 18 and 4, where per-projection gathers made 10, 24 and 10. The amaxes left per
    # layer: the 2 gathered inputs, o_proj's and down_proj's feature-split inputs, and the 5
    # column-parallel output gradients in backward. In high precision DTensor gathers the same 2
    # inputs a layer: every other activation gather (the row-parallel layers' backward, the head)
    # is the same in both runs.
    pytest.importorskip("transformers")
    bf16 = run_on_ranks(2, workers.sequence_parallel_collectives, "llama", False)
    for counts, high_precision in zip(run_on_ranks(2, workers.sequence_parallel_collectives, "llama", True), bf16):
        layers = counts.pop("layers")
        others = counts.pop("dtensor_gather")
        assert counts == {"gather": 2 * layers, "amax": 9 * layers, "reduce_scatter": 2 * layers}, counts
        assert high_precision["dtensor_gather"] == others + 2 * layers, (high_precision, others)


def test_compiled_fp8_linears_under_tp_stay_in_the_graph():
    # In a compiled layer, current-scaled FP8 linears under TP are traced (tp_forward.py [Note: FP8
    # under TP, compiled]): no graph break, and none of the eager tensor-parallel FP8 collectives
    # runs (their scale agreements are functional all-reduces in the graph). Opaque, they broke
    # the graph at every projection and ran all of them eagerly. One graph serves both layers and
    # both steps: the first layer's input (a DTensor over an async collective's tensor) and the KV
    # cache the model builds (another state at each layer) made Dynamo compile the layer three times.
    pytest.importorskip("transformers")
    for counts in run_on_ranks(2, workers.compiled_fp8_tp_in_graph, "llama"):
        assert counts == {"amax": 0, "gather": 0, "reduce_scatter": 0, "graph_breaks": 0, "graphs": 1}, counts


def test_compiled_checkpointed_layers_compile_once():
    # Checkpointed and compiled, the KV cache is taken out once, before the compiled code (the
    # outermost wrapper), so the layers' shared code compiles once. Under tensor and sequence
    # parallelism, FP8 linears traced: full checkpointing of a compiled layer failed here on torch
    # 2.13 in AOTAutograd ("expected all tensors_saved_with_vc_check to be Tensors";
    # checkpointing.py, compiled_full_contexts).
    pytest.importorskip("transformers")
    for counts in run_on_ranks(2, workers.compiled_fp8_tp_in_graph, "llama", "full"):
        assert counts == {"amax": 0, "gather": 0, "reduce_scatter": 0, "graph_breaks": 0, "graphs": 1}, counts


@pytest.mark.parametrize("checkpointing, sequence_parallel", [("selective", False), ("full", True)])
def test_compiled_units_keep_the_engine_hooks_outside(checkpointing, sequence_parallel):
    # aot_eager: Dynamo and AOTAutograd trace the checkpointed forward as inductor would,
    # without its minutes of C++ compilation on a CPU runner. No graph break: one inside the
    # checkpoint would run the checkpointed layer eagerly (the recompute-counting hook of an earlier
    # version of this test did, unseen). Compiled full checkpointing under TP failed on a CPU before it
    # kept attention's outputs there (checkpointing.py, compiled_full_contexts).
    for out in run_on_ranks(4, workers.compiled, "builtin", {"backend": "aot_eager"}, checkpointing,
                            sequence_parallel):
        errors = out["errors"]
        assert out["graph_breaks"] == 0, out
        assert errors["loss"] <= LOSS_TOL and errors["grad"] <= FP32_TOL and errors["weight"] <= FP32_TOL, errors
        assert out["gathers"] == {"<root>": 1, "layers.0": 2, "layers.1": 1}


def test_compiled_hf_layers_under_sequence_parallelism_match_one_process():
    # Hugging Face's plan under sequence parallelism, compiled: attention and the MLP gather their
    # input once (GatherSequenceOnce) and the one gather's backward sums q/k/v's (gate/up's) partial
    # input gradients. This holds the sums right (fp32 parity with one process, as eager TP has);
    # that the gather happens once is test_tp_engine.py's collectives test.
    # Fresh ranks: after test_ep.py's world-4 runs (the FP8 dispatch ones among them) the same ranks
    # failed here in AOTAutograd's partitioner ("Node tangents_2 was invalid, but is output"), the
    # process-history-dependent torch 2.13 failure test_ep.py's test_ep2_with_tp2_compiled meets.
    retire_pool(4)
    pytest.importorskip("transformers")
    for out in run_on_ranks(4, workers.compiled, "llama", {"backend": "aot_eager"}, "none", True):
        errors = out["errors"]
        assert errors["loss"] <= LOSS_TOL and errors["grad"] <= FP32_TOL and errors["weight"] <= FP32_TOL, errors


def test_compiled_units_pass_the_gradient_to_the_embedding():
    # Without checkpointing the first compiled layer's input is the embedding's asynchronous
    # all-reduce output (an AsyncCollectiveTensor), which AOTAutograd traced as not requiring
    # grad: the embedding got a zero gradient (comm.py [Note: async-collective inputs]).
    for out in run_on_ranks(4, workers.compiled, "builtin", {"backend": "aot_eager"}, "none"):
        errors = out["errors"]
        assert errors["loss"] <= LOSS_TOL and errors["grad"] <= FP32_TOL and errors["weight"] <= FP32_TOL, errors


def test_hf_checkpoint_directory(tmp_path):
    pytest.importorskip("transformers")
    for out in run_on_ranks(4, workers.from_checkpoint_directory, str(tmp_path / "qwen2")):
        for how, got in out.items():
            assert got["weights"] == 0.0 and got["logits"] <= 1e-5 and got["tied"], (how, got)


def test_skip_packed_sequence_check():
    pytest.importorskip("transformers")
    out = run_on_ranks(1, workers.packed_sequence_check)[0]
    assert out["replaced"] == {"flash": True, "mask": True}
    # Unpacked rows: the same answers as transformers' checks (packed rows: "not packed",
    # which is why the option is off by default), and the same logits.
    for name in ("flash", "mask"):
        assert out["answers"][name] == {"original": (False, True), "patched": (False, False)}, name
    assert out["logits"] == 0.0


BAD_WORLDS = [
    (("builtin", {"tp": 3}), "the given sizes multiply to 3, which does not divide the world of 4 ranks"),
    (("builtin", {"dp_shard": 4, "tp": -1, "sequence_parallel": True}),
     "sequence_parallel need tensor parallelism, but tp came out as 1 on 4 ranks"),
    (("mlp", {"tp": 2}), "no automatic tensor-parallel plan for Sequential (fsdp8 knows the plans of its own Llama and "
                         "of Hugging Face models); pass ParallelConfig(tp_plan={'module pattern': ParallelStyle"),
    (("builtin", {"tp": 4}), "tp=4 must divide n_kv_heads=2 (each rank computes whole heads); use tp in (1, 2), which "
                             "divide them all (parallelize passes ParallelConfig.tp_plan as tensor_parallel's plan)"),
]


def test_configs_this_world_cannot_run_raise_on_every_rank():
    cases = [case for case, _ in BAD_WORLDS]
    for per_rank in run_on_ranks(4, workers.bad_worlds, cases):
        for (message, untouched), (_, expected) in zip(per_rank, BAD_WORLDS):
            assert message is not None and expected in message, message
            assert untouched


# -- the selective policy, in one process ------------------------------------------------------
class _Ctx:
    def __init__(self, is_recompute):
        self.is_recompute = is_recompute


def test_selective_policy_keeps_every_other_matmul_and_attention():
    aten = torch.ops.aten
    ops = [aten.mm.default, aten.addmm.default, aten.mm.default, aten.add.Tensor, aten.silu.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.aminmax.default, aten.mm.default,
           aten.amax.default]  # aminmax: fsdp8's eager amax; amax: its compiled one
    policy = _selective_policy({"forward": 0, "recompute": 0})
    forward = [policy(_Ctx(False), op).name for op in ops]
    assert forward == ["MUST_SAVE", "PREFER_RECOMPUTE", "MUST_SAVE", "PREFER_RECOMPUTE", "PREFER_RECOMPUTE",
                       "MUST_SAVE", "MUST_SAVE", "PREFER_RECOMPUTE", "MUST_SAVE"]
    assert [policy(_Ctx(True), op).name for op in ops] == forward  # recomputation counts afresh


def test_compiled_full_policy_keeps_only_random_ops_on_a_cpu():
    # Compiled full checkpointing (checkpointing.py, compiled_full_contexts): SDPA computing on a CPU
    # is kept (torch 2.13 cannot recompute it beside DTensor parameters there); on any other device,
    # and every other op, everything is recomputed.
    aten = torch.ops.aten
    cpu, elsewhere = torch.zeros(2), torch.zeros(2, device="meta")
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    decide = {(op, t.device.type): _full_compiled_policy(_Ctx(False), op, t).name
              for op in (attention, aten.mm.default, aten.add.Tensor) for t in (cpu, elsewhere)}
    assert decide == {(attention, "cpu"): "MUST_SAVE", (attention, "meta"): "PREFER_RECOMPUTE",
                      (aten.mm.default, "cpu"): "PREFER_RECOMPUTE", (aten.mm.default, "meta"): "PREFER_RECOMPUTE",
                      (aten.add.Tensor, "cpu"): "PREFER_RECOMPUTE", (aten.add.Tensor, "meta"): "PREFER_RECOMPUTE"}


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,recomputed", [("full", 4), ("selective", 2)])
def test_checkpointing_recomputes_what_the_mode_says(mode, recomputed):
    torch.manual_seed(0)
    plain, x = _Chain(), torch.randn(3, 8, requires_grad=True)
    wrapped = _Chain()
    wrapped.load_state_dict(plain.state_dict())
    checkpoint_units([wrapped], mode)
    counts = []
    for model in (plain, wrapped):
        y = model(x).square().sum()
        with _CountMatmuls() as counter:
            grads = torch.autograd.grad(y, [x, *model.parameters()])
        counts.append(counter.count)
        if model is plain:
            expected = grads
    assert counts[1] - counts[0] == recomputed  # matmuls run again in backward
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    with torch.no_grad():
        assert torch.equal(wrapped(x), plain(x))  # no checkpoint where no backward follows


def test_auto_layout():
    # Every rank plans alike and gets the search's first configuration; it trains as one process.
    results = run_on_ranks(4, workers.auto_layout)
    assert len({r["chosen"] for r in results}) == 1 and all(r["matches_search"] for r in results)
    assert results[0]["explicit_error"] == 0.0
    if BACKEND == "gloo":  # fp32 compute; on GPUs the chosen layout computes in bf16
        assert results[0]["loss_error"] < 1e-5


def test_a_registered_adapter_lays_out_a_model_of_ones_own():
    # Before its family has an adapter, a model of one's own gets the generic one: today's
    # errors for tp and cp, fully_shard's default units (none in it: its blocks are in no
    # ModuleList). With a user's adapter registered, parallelize takes units and plan from it.
    for out in run_on_ranks(4, workers.own_adapter):
        assert out["errors"]["tp"].startswith("no automatic tensor-parallel plan for OwnModel (fsdp8 knows the plans "
                                              "of its own Llama and of Hugging Face models); pass ParallelConfig(")
        assert out["errors"]["cp"].startswith("context parallelism (cp=2) replaces the attention of fsdp8's Llama and "
                                              "of Hugging Face models, not of OwnModel; use cp=1")
        assert out["default_units"] == []
        assert out["units"] == ["first", "second"] and {"units", "tp_plan"} <= set(out["asked"])
        # The plan's colwise up and rowwise down, on the tp dim of the main weights.
        assert out["on_tp"] == {"first.up.weight": "Shard(dim=0)", "first.down.weight": "Shard(dim=1)"}
        errors = out["run"]["errors"]
        assert errors["loss"] <= LOSS_TOL and errors["grad"] <= FP32_TOL and errors["weight"] <= FP32_TOL, errors
        assert out["run"]["gathers"] == {"<root>": 1, "first": 2, "second": 1}
