"""Mixture-of-experts blocks (fsdp8/models/moe.py) and the built-in Llama's MoE layers, against
independent references: per-row products for the grouped GEMM, Python's stable sort for the
permutation, transformers' own experts, router, loss and Mixtral model."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import fsdp8
from fsdp8.checkpoint import CheckpointError, export, hf_export
from fsdp8.models import adapter_for
from fsdp8.models import moe
from fsdp8.models.llama import Block, Llama, LlamaConfig, preset
from fsdp8.models.moe import Experts, MoE, experts_forward, grouped_mm, permute_by_expert
from fsdp8.models.tp_plan import ExpertParallelBlock
from tests.unit.test_llama import materialize, reset_real

SMALL_MOE = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16,
                        num_experts=4, num_experts_per_tok=2, moe_ffn_dim=16, router_aux_loss_coef=0.1)


def small_moe(**overrides) -> LlamaConfig:
    return dataclasses.replace(SMALL_MOE, **overrides)


def tokens(batch=2, seq=16, seed=0):
    return torch.randint(0, SMALL_MOE.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def offsets(sizes) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def per_row_reference(x, weight, offs):
    """Each row times the weight of the group its index falls in (no split, no GEMM per group)."""
    group = torch.searchsorted(offs.long(), torch.arange(x.shape[0]), right=True)
    return torch.einsum("tk,tnk->tn", x, weight[group])


def grads(out, inputs, seed=1):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


# Empty groups in the middle and at both ends.
SIZES = [[0, 3, 0, 9, 4, 0], [5, 0, 0, 11], [0, 0, 7]]


# -- grouped_mm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_mm_torch_op_equals_the_loop_in_fp32(sizes):
    torch.manual_seed(0)
    x = torch.randn(sum(sizes), 16, requires_grad=True)
    w = torch.randn(len(sizes), 32, 16, requires_grad=True)
    if not moe._op_fits(x, w):
        pytest.skip("this torch has no working CPU torch._grouped_mm for fp32 (the loop is all there is)")
    offs = offsets(sizes)
    got = grouped_mm(x, w, offs)
    want = moe._grouped_mm_loop(x, w, offs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    for a, b in zip(grads(got, (x, w)), grads(want, (x, w))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dtype, k, n", [(torch.float64, 16, 32), (torch.float32, 16, 32), (torch.float32, 5, 3)])
def test_grouped_mm_equals_a_per_row_reference(sizes, dtype, k, n):
    """fp64 (the loop), fp32 aligned (torch's op where it works) and misaligned (the loop)."""
    torch.manual_seed(0)
    x = torch.randn(sum(sizes), k, dtype=dtype, requires_grad=True)
    w = torch.randn(len(sizes), n, k, dtype=dtype, requires_grad=True)
    offs = offsets(sizes)
    got, want = grouped_mm(x, w, offs), per_row_reference(x, w, offs)
    bound = 1e-14 if dtype == torch.float64 else 1e-6
    assert rel_err(got, want) < bound
    got_grads = grads(got, (x, w))
    for a, b in zip(got_grads, grads(want, (x, w))):
        assert rel_err(a, b) < bound
    empty = [g for g, s in enumerate(sizes) if s == 0]
    assert torch.equal(got_grads[1][empty], torch.zeros_like(w[empty]))  # an empty group's weight gets none


def test_grouped_mm_takes_the_stride_0_gradient_of_a_sum():
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(2, 16, 16, requires_grad=True)
    grouped_mm(x, w, offsets([3, 5])).sum().backward()
    torch.testing.assert_close(x.grad, per_row_reference(torch.ones(8, 16), w.detach().transpose(1, 2),
                                                         offsets([3, 5])))


def test_grouped_mm_in_bf16_is_a_rounded_exact_product():
    torch.manual_seed(0)
    x, w = torch.randn(12, 16).bfloat16(), torch.randn(3, 32, 16).bfloat16()
    offs = offsets([4, 0, 8])
    got, exact = grouped_mm(x, w, offs), per_row_reference(x.double(), w.double(), offs)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-30).all()


# -- permute_by_expert -----------------------------------------------------------------------------
def test_permute_by_expert_is_a_stable_sort_with_its_inverse_and_counts():
    index = torch.randint(0, 5, (40, 3), generator=torch.Generator().manual_seed(0))
    index[index == 2] = 3  # an expert with no tokens
    order, inverse, counts = permute_by_expert(index, 6)
    flat = index.flatten().tolist()
    assert order.tolist() == sorted(range(len(flat)), key=lambda i: flat[i])  # Python's sort is stable
    assert [order.tolist().index(i) for i in range(len(flat))] == inverse.tolist()
    assert order.dtype == torch.int64 and counts.dtype == torch.int64
    assert counts.tolist() == [flat.count(e) for e in range(6)]


# -- experts_forward against transformers ----------------------------------------------------------
def hf_model(kind: str):
    """A one-layer transformers MoE model whose experts run their eager loop (the reference), with
    experts of a larger scale than transformers' init (any values do)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, f"{kind}Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {kind}")
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2)
    if kind == "Qwen3Moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=5, **sizes)
    else:
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=5, **sizes)
    config._experts_implementation = "eager"  # their loop over experts, the reference
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(config)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("kind", ["Qwen3Moe", "Mixtral"])
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
def test_experts_forward_equals_transformers_eager_experts(kind, dtype, bound):
    experts = hf_model(kind).model.layers[0].mlp.experts.to(dtype)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(24, 32, generator=g, dtype=dtype, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])  # expert 4 gets nothing
    weights = torch.rand(24, 2, generator=g, dtype=dtype, requires_grad=True)
    inputs = (hidden, weights, experts.gate_up_proj, experts.down_proj)
    want = experts(hidden, index, weights)
    got = experts_forward(experts, hidden, index, weights)
    assert got.dtype == want.dtype and rel_err(got, want) < bound
    for name, a, b in zip(("hidden", "weights", "gate_up_proj", "down_proj"), grads(got, inputs), grads(want, inputs)):
        assert rel_err(a, b) < bound, name


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_layer_equals_qwen3_moe_sparse_block(norm_topk_prob):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = small_moe(norm_topk_prob=norm_topk_prob)
    hf_config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4,
                                            num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    hf_config._experts_implementation = "eager"
    torch.manual_seed(0)
    ours = MoE(config).double()
    theirs = Qwen3MoeSparseMoeBlock(hf_config).double()
    theirs.load_state_dict(ours.state_dict())  # the same names: gate.weight, experts.gate_up_proj, ...
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    out, aux = ours(x)
    assert rel_err(out, theirs(x)) < 1e-12
    # transformers' loss counts each expert's share per token, k times ours.
    logits = x.flatten(0, 1) @ ours.gate.weight.T
    hf_aux = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func((logits,), 4, 2)
    torch.testing.assert_close(aux, (hf_aux / 2).to(aux.dtype))


# -- the built-in Llama's MoE layers ---------------------------------------------------------------
def aux_reference(model: Llama, x: torch.Tensor) -> torch.Tensor:
    """Each layer's load-balancing loss from its router's input (caught by a hook), written out."""
    inputs = []
    hooks = [layer.ffn.gate.register_forward_hook(lambda m, a, o: inputs.append((a[0], m.weight)))
             for layer in model.layers]
    with torch.no_grad():
        logits = model(x)
    for h in hooks:
        h.remove()
    losses = []
    for rows, weight in inputs:
        probs = torch.softmax(rows.double() @ weight.double().T, dim=-1)
        chosen = F.one_hot(probs.topk(model.config.num_experts_per_tok, dim=-1).indices, weight.shape[0])
        share = chosen.double().sum((0, 1)) / chosen.sum()
        losses.append(weight.shape[0] * (share * probs.mean(0)).sum())
    return logits, torch.stack(losses)


def test_moe_llama_loss_is_cross_entropy_plus_the_aux_losses():
    torch.manual_seed(0)
    model = Llama(SMALL_MOE)
    x, y = tokens(), tokens(seed=1)
    logits, aux = aux_reference(model, x)
    assert aux.shape == (2,) and (aux >= 1 - 1e-6).all()  # 1 is its minimum: perfectly balanced
    ce = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten())
    loss = model(x, y)
    torch.testing.assert_close(loss.double(), ce + 0.1 * aux.sum(), rtol=1e-5, atol=1e-6)
    # With num_items_in_batch: a sum over the counted targets, the aux term weighted by their share.
    y[0, :5] = -100
    ce_sum = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum")
    loss = model(x, y, num_items_in_batch=40.0)
    torch.testing.assert_close(loss.double(), (ce_sum + 0.1 * aux.sum() * 27) / 40, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.layers[0].ffn.gate.weight.grad.abs().sum() > 0


def test_moe_llama_is_transformers_mixtral():
    """The MoE Llama with renormalised top-k is Mixtral: export's names and config.json give a
    MixtralForCausalLM with the same logits (fp64), and a run's checkpoint exports as one."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = Llama(SMALL_MOE)
    config = transformers.MixtralConfig(**hf_export.llama_config_json(SMALL_MOE, torch.float64))
    config._experts_implementation = "eager"
    theirs = transformers.MixtralForCausalLM(config).double().eval()
    tensors = hf_export.llama_tensors(ours.state_dict(), SMALL_MOE, "the model")
    missing, unexpected = theirs.load_state_dict(tensors, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    x = tokens()
    assert rel_err(ours.double()(x), theirs(x).logits) < 1e-12
    with pytest.raises(CheckpointError, match="norm_topk_prob=False, which export cannot write"):
        hf_export.llama_tensors(ours.state_dict(), small_moe(norm_topk_prob=False), "the model")


def test_a_moe_run_trains_under_the_engine_and_exports_as_mixtral(tmp_path):
    """fully_shard on one process (the engine's hooks see each block's (output, aux loss)), a
    meta-device build materialised by the engine, a step, save and export."""
    transformers = pytest.importorskip("transformers")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the engine materialises
    torch.manual_seed(0)
    with device:
        plain = Llama(small_moe(checkpoint_activations=True))
    with torch.device("meta"):
        meta = Llama(small_moe(checkpoint_activations=True))
    torch.manual_seed(0)
    model = fsdp8.fully_shard(meta)
    x, y = tokens().to(device), tokens(seed=1).to(device)
    loss = model(x, y)
    torch.testing.assert_close(loss, plain(x, y), rtol=0, atol=0)  # the same draws, in the same order
    loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    fsdp8.save(str(tmp_path / "c"), model, opt)
    export(str(tmp_path / "c"), str(tmp_path / "out"), llama=SMALL_MOE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert type(hf).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert rel_err(hf(x.cpu()).logits, model(x).cpu()) < 1e-5


def test_activation_checkpointing_keeps_moe_loss_and_grads():
    torch.manual_seed(0)
    plain = Llama(SMALL_MOE)
    ckpt = Llama(small_moe(checkpoint_activations=True))
    ckpt.load_state_dict(plain.state_dict())
    x, y = tokens(), tokens(seed=1)
    _, aux = aux_reference(plain, x)
    losses = []
    for model in (plain, ckpt, ckpt):  # twice: a recomputation leaves nothing behind for the next step
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        losses.append(loss)
    assert losses[0] == losses[1] == losses[2]
    ce = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(losses[1].double(), ce.double() + 0.1 * aux.sum(), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("selective", [False, True])
def test_the_first_call_may_come_inside_a_checkpointed_region(monkeypatch, selective):
    """The grouped GEMM's probe runs apart: the region's recomputation saves what its forward
    saved, and selective checkpointing's op cache sees the same ops."""
    from torch.utils.checkpoint import checkpoint

    from fsdp8.parallel.checkpointing import selective_contexts

    monkeypatch.setattr(moe, "_OP_WORKS", {})
    torch.manual_seed(0)
    layer = MoE(SMALL_MOE)
    x = torch.randn(2, 8, 32, requires_grad=True)
    extra = {"context_fn": selective_contexts} if selective else {}
    out, aux = checkpoint(layer, x, use_reentrant=False, **extra)
    (out.square().sum() + aux).backward()
    got = (x.grad, *(p.grad for p in layer.parameters()))
    x.grad = None
    layer.zero_grad()
    out, aux = layer(x)
    (out.square().sum() + aux).backward()
    for a, b in zip(got, (x.grad, *(p.grad for p in layer.parameters()))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert moe._OP_WORKS  # probed there


def test_moe_meta_materialisation_matches_cpu_build():
    with torch.device("meta"):
        meta = Llama(SMALL_MOE)
    torch.manual_seed(3)
    materialize(meta)
    cpu = Llama(SMALL_MOE)
    torch.manual_seed(3)
    reset_real(cpu)
    torch.manual_seed(3)
    built = Llama(SMALL_MOE)
    for reference in (cpu, built):
        for (name, a), b in zip(meta.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    experts = meta.layers[0].ffn.experts
    assert experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.1)
    assert experts.down_proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 2), rel=0.1)
    x = tokens()
    torch.testing.assert_close(meta(x), cpu(x), rtol=0, atol=0)


def test_dense_preset_is_unchanged():
    c = preset("tiny")
    model = Llama(c)
    layer = ["attn_norm", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn_norm", "ffn.w1", "ffn.w3", "ffn.w2"]
    names = ["embed.weight", *(f"layers.{i}.{p}.weight" for i in range(4) for p in layer), "norm.weight",
             "head.weight"]
    assert [n for n, _ in model.named_parameters()] == names
    kv = c.n_kv_heads * c.head_dim
    per_layer = 2 * c.dim + 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim
    assert model.num_params() == model.num_active_params() == 2 * c.vocab_size * c.dim + c.dim + 4 * per_layer
    assert isinstance(model.layers[0](torch.zeros(1, 4, c.dim), *model.rotary(4, torch.float32)), torch.Tensor)


def test_moe_counts_and_flops():
    c = preset("moe-tiny")
    model = Llama(c)
    assert [n for n, _ in model.layers[0].named_parameters()][-3:] == [
        "ffn.gate.weight", "ffn.experts.gate_up_proj", "ffn.experts.down_proj"]
    expert = 3 * c.dim * c.moe_ffn_dim
    kv = c.n_kv_heads * c.head_dim
    shared = 2 * c.dim + 2 * c.dim * c.dim + 2 * c.dim * kv + c.num_experts * c.dim  # norms, attention, router
    total = 2 * c.vocab_size * c.dim + c.dim + c.n_layers * (shared + c.num_experts * expert)
    active = total - c.n_layers * (c.num_experts - c.num_experts_per_tok) * expert
    assert model.num_params() == total and model.num_active_params() == active
    matmul = active - c.vocab_size * c.dim
    assert model.flops_per_token(64) == 6 * matmul + 12 * c.n_layers * c.dim * 64
    with torch.device("meta"):
        big = Llama(preset("moe-1b"))
    assert 0.85e9 < big.num_params() < 1.0e9 and 0.18e9 < big.num_active_params() < 0.25e9


@pytest.mark.parametrize("overrides, message", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 routes each token to more experts than the num_experts=4 "
                                  "there are; pass num_experts_per_tok <= 4"),
    (dict(num_experts=-1), "num_experts must be an int >= 0"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok must be a positive int"),
    (dict(moe_ffn_dim=1.5), "moe_ffn_dim must be an int >= 0"),
    (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef must be >= 0"),
])
def test_moe_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_moe(**overrides)


def test_a_dense_config_ignores_the_expert_count_per_token():
    assert small_moe(num_experts=0, num_experts_per_tok=8).num_experts == 0


# -- adapters --------------------------------------------------------------------------------------
def test_adapters_name_and_size_the_experts_and_leave_them_out_of_tensor_parallelism():
    model = Llama(SMALL_MOE)
    adapter = adapter_for(model)
    assert list(adapter.experts(model)) == ["layers.0.ffn.experts", "layers.1.ffn.experts"]
    assert all(isinstance(m, Experts) for m in adapter.experts(model).values())
    assert not any(adapter.swiglu_names(m) for m in model.modules())
    spec = adapter.planner_spec(model)  # what parallelize(model, "auto") plans with
    assert (spec.experts, spec.experts_per_token, spec.expert_ffn, spec.moe_layers) == (4, 2, 16, 2)
    assert (spec.num_params, spec.num_active_params) == (model.num_params(), model.num_active_params())
    # Attention tensor-parallel; each MoE block an ExpertParallelBlock (router replicated, experts to ep).
    for sp in (False, True):
        styles = adapter.tp_plan(model, sp, False).styles
        assert isinstance(styles["layers.*.ffn"], ExpertParallelBlock) and styles["layers.*.ffn"].sequence_parallel is sp
        assert not any("experts" in key or key.startswith("layers.*.ffn.") for key in styles), sorted(styles)
    dense = Llama(small_moe(num_experts=0))
    assert adapter.experts(dense) == {} and sum(bool(adapter.swiglu_names(m)) for m in dense.modules()) == 2
    assert isinstance(dense.layers[0], Block)

    for kind in ("Qwen3Moe", "Mixtral"):
        hf = hf_model(kind)
        assert list(adapter_for(hf).experts(hf)) == ["model.layers.0.mlp.experts"]
        plan = adapter_for(hf).tp_plan(hf, True, False)  # transformers' packed/MoE expert styles dropped
        assert plan.unsupported == {} and not any("experts" in key for key in plan.styles), plan
        block = plan.styles["model.layers.0.mlp"]
        assert isinstance(block, ExpertParallelBlock) and not block.use_local_output


def test_fp8_conversion_converts_experts_and_names_routers_kept_in_high_precision():
    # FP8 recipes convert nn.Linear layers and give the experts a recipe for their grouped GEMMs;
    # the routers stay in high precision, and one warning says which and why (never silently).
    import warnings

    import fsdp8
    from fsdp8.fp8.convert import HighPrecisionLayerWarning, convert_to_fp8, projection_layers
    from fsdp8.models.llama import Llama, preset

    model = Llama(preset("moe-tiny", n_layers=2))
    recipe = fsdp8.Float8CurrentScaling()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_fp8(model, recipe)
    messages = [str(w.message) for w in caught if w.category is HighPrecisionLayerWarning]
    assert len(messages) == 1, messages
    assert "kept 2 router(s) in high precision" in messages[0]
    assert "ffn.experts" not in messages[0] and "mixture-of-experts" not in messages[0], messages[0]
    assert all(model.layers[i].ffn.experts.fp8_recipe is recipe for i in range(2))
    assert isinstance(model.layers[0].attn.wq, fsdp8.fp8.Float8Linear)
    fp8, high = projection_layers(model)
    assert "layers.1.ffn.experts" in fp8 and [h for h in high if "gate" in h] == [
        "layers.0.ffn.gate (Router)", "layers.1.ffn.gate (Router)"], (fp8, high)


def test_fp8_dispatch_rows_are_each_rows_1x128_fp8_rounding():
    # [Note: FP8 dispatch]: what travels is each row's e4m3 bytes and its fp32 scales, one uint8 row;
    # what arrives is quantize(ROW_1x128) then dequantize of that row alone; its gradient passes through.
    from fsdp8.fp8.formats import Granularity
    from fsdp8.fp8.kernels import quantize
    from fsdp8.parallel.ep import _fp8_rows_packed, _fp8_rows_unpacked, rows_through_fp8

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 200, generator=g) * torch.logspace(-3, 3, 5)[:, None]).requires_grad_()
    packed = _fp8_rows_packed(x.detach())
    assert packed.dtype == torch.uint8 and packed.shape == (5, 200 + 4 * 2)
    want = quantize(x.detach(), torch.float8_e4m3fn, Granularity.ROW_1x128).dequantize(torch.float32)
    assert torch.equal(_fp8_rows_unpacked(packed, 200, torch.float32), want)
    # Row by row: a row's bytes do not depend on the rows beside it (any ep degree sends the same).
    assert torch.equal(torch.cat([_fp8_rows_packed(x.detach()[i:i + 1]) for i in range(5)]), packed)
    y = rows_through_fp8(x)
    assert torch.equal(y.detach(), want) and not torch.equal(y.detach(), x.detach())
    y.backward(torch.arange(1000.0).view(5, 200))
    assert torch.equal(x.grad, torch.arange(1000.0).view(5, 200))
    empty = _fp8_rows_packed(torch.empty(0, 200))
    assert empty.shape == (0, 208) and _fp8_rows_unpacked(empty, 200, torch.bfloat16).shape == (0, 200)
