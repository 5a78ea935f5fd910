"""Unit tests for the reference Llama: shapes, init, GQA, tying, meta-device init, checkpointing."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from fsdp8.models.llama import PRESETS, Llama, LlamaConfig, apply_rotary, preset

SMALL = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16
)


def small(**overrides) -> LlamaConfig:
    return dataclasses.replace(SMALL, **overrides)


def tokens(batch=2, seq=16, vocab=SMALL.vocab_size, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def materialize(model: nn.Module) -> None:
    """The engine's procedure: reset_parameters() on each module that directly owns a meta
    tensor, in modules() order, skipping parameters already made real through a tied module."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        fresh = False
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in done:
                module._parameters[name] = done[id(p)]
            elif p.is_meta:
                done[id(p)] = module._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"))
                fresh = True
        for name, b in module._buffers.items():
            if b.is_meta:
                module._buffers[name] = torch.empty_like(b, device="cpu")
                fresh = True
        if fresh:
            with torch.no_grad():
                module.reset_parameters()


def reset_real(model: nn.Module) -> None:
    """The same procedure on a model already on the CPU."""
    seen = set()
    for module in model.modules():
        params = [p for p in module._parameters.values() if p is not None and id(p) not in seen]
        if params or module._buffers:
            seen.update(id(p) for p in params)
            with torch.no_grad():
                module.reset_parameters()


def test_logits_shape_and_loss_dtype():
    model = Llama(SMALL)
    x = tokens(seq=10)
    assert model(x).shape == (2, 10, SMALL.vocab_size)
    loss = model(x, tokens(seq=10, seed=1))
    assert loss.shape == () and loss.dtype == torch.float32


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = Llama(preset("tiny"))
    loss = model(tokens(seq=64, vocab=256), tokens(seq=64, vocab=256, seed=1))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = Llama(small(n_kv_heads=2))
    mha = Llama(small(n_kv_heads=4))
    state = gqa.state_dict()
    for key in [k for k in state if k.endswith(("attn.wk.weight", "attn.wv.weight"))]:
        # kv head j serves query heads 2j and 2j + 1: repeat each head's rows in place.
        state[key] = state[key].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x))


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_variants_run(n_kv_heads):
    model = Llama(small(n_kv_heads=n_kv_heads))
    assert model.layers[0].attn.wk.weight.shape == (n_kv_heads * 8, 32)
    assert torch.isfinite(model(tokens(), tokens(seed=1)))


def test_tied_head_shares_the_embedding():
    model = Llama(small(tie_embeddings=True))
    assert model.head.weight is model.embed.weight
    assert model.num_params() == Llama(small()).num_params() - SMALL.vocab_size * SMALL.dim
    model(tokens(), tokens(seed=1)).backward()
    assert model.embed.weight.grad is not None


def test_output_projections_use_scaled_std():
    torch.manual_seed(0)
    model = Llama(preset("tiny"))
    block = model.layers[0]
    assert block.attn.wo.std == pytest.approx(0.02 / math.sqrt(8))
    assert block.ffn.w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert block.attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_materialisation_matches_cpu_build(tie):
    config = small(tie_embeddings=tie)
    with torch.device("meta"):
        meta = Llama(config)
    torch.manual_seed(3)
    materialize(meta)
    assert not any(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert (meta.head.weight is meta.embed.weight) == tie

    cpu = Llama(config)
    torch.manual_seed(3)
    reset_real(cpu)
    torch.manual_seed(3)
    built = Llama(config)  # construction draws in modules() order, so it matches too
    for reference in (cpu, built):
        for (name, a), b in zip(meta.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(meta.rotary.cos, reference.rotary.cos, rtol=0, atol=0)
    x = tokens()
    assert torch.isfinite(meta(x)).all()
    torch.testing.assert_close(meta(x), cpu(x), rtol=0, atol=0)


def test_activation_checkpointing_keeps_loss_and_grads():
    torch.manual_seed(0)
    plain = Llama(SMALL)
    ckpt = Llama(small(checkpoint_activations=True))
    ckpt.load_state_dict(plain.state_dict())
    x, y = tokens(), tokens(seed=1)
    losses = []
    for model in (plain, ckpt):
        loss = model(x, y)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_bf16_parameters_give_bf16_activations():
    model = Llama(SMALL).to(torch.bfloat16)
    assert model(tokens()).dtype == torch.bfloat16
    assert model(tokens(), tokens(seed=1)).dtype == torch.float32


def test_rotary_is_a_rotation():
    model = Llama(SMALL)
    cos, sin = model.rotary(16, torch.float32)
    assert cos.shape == (16, 4)
    x = torch.randn(2, 4, 16, 8)
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])  # position 0 is not rotated


def test_sequence_longer_than_max_seq_len_is_an_error():
    with pytest.raises(ValueError, match="max_seq_len"):
        Llama(SMALL)(tokens(seq=17))


def test_presets_and_counts():
    assert preset("tiny") == PRESETS["tiny"]
    assert preset("tiny", checkpoint_activations=True).checkpoint_activations
    with pytest.raises(ValueError, match="tiny, small, 1b, 8b"):
        preset("huge")
    with torch.device("meta"):
        llama3_8b = Llama(preset("8b"))
    assert llama3_8b.num_params() == 8_030_261_248
    tiny = Llama(preset("tiny"))
    n = tiny.num_params(exclude_embedding=True)
    assert n == tiny.num_params() - 256 * 128
    assert tiny.flops_per_token(128) == 6 * n + 12 * 4 * 128 * 128


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dim=30), "divisible by n_heads"),
        (dict(n_kv_heads=3), "divisible by n_kv_heads"),
        (dict(dim=12, n_heads=4), "must be even"),
        (dict(n_layers=0), "n_layers must be a positive int"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(norm_eps=0.0), "norm_eps must be positive"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        small(**overrides)


def test_bf16_linear_on_cpu_is_a_bf16_gemm():
    """The CPU bf16 path (an fp32 GEMM of the bf16 values, rounded once) gives what a bf16
    GEMM defines: the exactly summed products rounded to bf16, up to fp32 summation order
    (so within one bf16 step of the float64 result), for the output and both gradients."""
    from fsdp8.models.llama import Linear

    from torch.utils._python_dispatch import TorchDispatchMode

    class GemmDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                self.seen.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = Linear(96, 80, std=0.5).to(torch.bfloat16)
    x = torch.randn(33, 96, dtype=torch.bfloat16, requires_grad=True)
    with GemmDtypes() as gemms:
        out = layer(x)
        grad = torch.randn_like(out)
        out.backward(grad)
    assert out.dtype == torch.bfloat16
    # The point of the path: torch's CPU bf16 GEMM is what it avoids (forward, dgrad, wgrad).
    assert gemms.seen == [torch.float32] * 3, gemms.seen
    w64, x64, g64 = layer.weight.double(), x.detach().double(), grad.double()
    for got, exact in ((out, x64 @ w64.t()), (x.grad, g64 @ w64), (layer.weight.grad, g64.t() @ x64)):
        step = exact.abs().clamp_min(1e-30) * 2.0**-7  # one bf16 step (8-bit significand) or less
        assert ((got.double() - exact).abs() <= step).all()
        assert not torch.equal(got.double(), exact)  # rounded: the bound is not vacuous


@pytest.mark.parametrize("ranks", [2, 4])
def test_attention_computes_with_a_slice_of_heads(ranks):
    """What a tensor-parallel rank holds: the wq/wk/wv rows of its heads (whole kv groups) and
    wo's matching columns. Each slice must run, and the slices' outputs sum to the full one."""
    torch.manual_seed(0)
    config = small(n_heads=4, n_kv_heads=ranks if ranks == 4 else 2)
    model = Llama(config)
    full = model.layers[0].attn
    x = torch.randn(2, 8, config.dim)
    cos, sin = model.rotary(8, torch.float32)
    q_rows, kv_rows = config.dim // ranks, config.n_kv_heads * config.head_dim // ranks
    total = torch.zeros_like(x)
    for r in range(ranks):
        part = copy.deepcopy(full)
        with torch.no_grad():
            part.wq.weight = nn.Parameter(full.wq.weight[r * q_rows:(r + 1) * q_rows])
            part.wk.weight = nn.Parameter(full.wk.weight[r * kv_rows:(r + 1) * kv_rows])
            part.wv.weight = nn.Parameter(full.wv.weight[r * kv_rows:(r + 1) * kv_rows])
            part.wo.weight = nn.Parameter(full.wo.weight[:, r * q_rows:(r + 1) * q_rows])
            total += part(x, cos, sin)
    torch.testing.assert_close(total, full(x, cos, sin), rtol=1e-5, atol=1e-6)
