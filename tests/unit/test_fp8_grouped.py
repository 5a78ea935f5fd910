"""FP8 expert GEMMs (fsdp8/fp8/grouped.py), single process on CPU: each group exactly the dense FP8
linear on that group's rows, per-expert scales, conversion of experts modules, and a converted
mixture-of-experts Llama training close to fp32."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn

import fsdp8
from fsdp8.fp8.convert import HighPrecisionLayerWarning, convert_to_fp8
from fsdp8.fp8.grouped import fp8_grouped_mm
from fsdp8.fp8.linear_fn import Float8LinearFn
from fsdp8.fp8.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from fsdp8.models import moe
from fsdp8.models.llama import Llama, preset
from tests.unit.test_fp8 import UNIT_ROUNDOFF

RECIPES = [Float8CurrentScaling(), Float8CurrentScaling(fp8_format="e4m3"), Float8BlockScaling(), MXFP8BlockScaling()]
ids = lambda r: f"{r.name}-{r.fp8_format}"  # noqa: E731

# Empty groups first, in the middle and last; one group over 128 rows (two token blocks of 1x128,
# the second partial). K = 160 leaves a partial 1x128 block along K; N = 48 a partial 128x128 block
# per expert (padded, so no block straddles two experts).
SIZES, K, N = [0, 150, 3, 0, 40, 0], 160, 48


def offsets(sizes) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def dense_reference(x, weight, sizes, dy, recipe):
    """out, dx, dw from the dense FP8 linear (Float8LinearFn) run on each group alone."""
    outs, dxs, dws, start = [], [], [], 0
    for g, rows in enumerate(sizes):
        xg = x.detach()[start:start + rows].clone().requires_grad_()
        wg = weight.detach()[g].clone().requires_grad_()
        if rows:
            out = Float8LinearFn.apply(xg, wg, None, recipe, None)
            dx, dw = torch.autograd.grad(out, (xg, wg), dy[start:start + rows])
            outs.append(out), dxs.append(dx), dws.append(dw)
        else:
            dws.append(torch.zeros_like(wg))  # no rows: no gradient
        start += rows
    return torch.cat(outs), torch.cat(dxs), torch.stack(dws)


def grouped(x, weight, sizes, dy, recipe):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fp8_grouped_mm(x, weight, offsets(sizes), recipe)
    return (out, *torch.autograd.grad(out, (x, weight), dy))


@pytest.mark.parametrize("recipe", RECIPES, ids=ids)
def test_fp8_grouped_mm_is_the_dense_fp8_linear_on_each_group(recipe):
    # fp64 compute: both sides take the emulation's fp64 products of the same FP8 operands, in the
    # same shapes, so every value is the same bit for bit.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SIZES), K, generator=g, dtype=torch.float64)
    weight = torch.randn(len(SIZES), N, K, generator=g, dtype=torch.float64)
    dy = torch.randn(sum(SIZES), N, generator=g, dtype=torch.float64)
    for got, want in zip(grouped(x, weight, SIZES, dy, recipe), dense_reference(x, weight, SIZES, dy, recipe)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def rms_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling()], ids=ids)
def test_experts_of_very_different_magnitudes_keep_their_precision(recipe):
    """Experts 1e-4, 1 and 1e4 in size (rows and weight alike): scaled per expert, each group's
    out, dx and dw are within the FP8 rounding of its exact value (for independent relative errors
    uniform in [-u, u] a product's RMS relative error is sqrt((u_a**2 + u_b**2) / 3); allow 1.5x).
    One scale for all experts would flush the smallest to zero (e4m3 spans ~2**26 = 6.7e7; the
    products of the 1e-4 expert sit 1e16 below those of the 1e4 one)."""
    g = torch.Generator().manual_seed(0)
    sizes, magnitudes = [24, 16, 8], [1e-4, 1.0, 1e4]
    scale_rows = torch.tensor(magnitudes, dtype=torch.float64).repeat_interleave(torch.tensor(sizes))[:, None]
    x = torch.randn(sum(sizes), 64, generator=g, dtype=torch.float64) * scale_rows
    weight = torch.randn(3, 32, 64, generator=g, dtype=torch.float64) * torch.tensor(magnitudes)[:, None, None]
    dy = torch.randn(sum(sizes), 32, generator=g, dtype=torch.float64) * scale_rows
    out, dx, dw = grouped(x, weight, sizes, dy, recipe)
    u_f, u_b = UNIT_ROUNDOFF[recipe.fwd_dtype], UNIT_ROUNDOFF[recipe.bwd_dtype]
    bound_fwd, bound_bwd = 1.5 * math.sqrt(2 * u_f**2 / 3), 1.5 * math.sqrt((u_f**2 + u_b**2) / 3)
    start = 0
    for e, rows in enumerate(sizes):
        xe, dye, r = x[start:start + rows], dy[start:start + rows], slice(start, start + rows)
        assert rms_rel(out[r], xe @ weight[e].t()) <= bound_fwd, e
        assert rms_rel(dx[r], dye @ weight[e]) <= bound_bwd, e
        assert rms_rel(dw[e], dye.t() @ xe) <= bound_bwd, e
        start += rows


def test_delayed_experts_are_the_dense_delayed_linear_on_each_group_step_after_step():
    """Each expert keeps its own amax history (grouped_delayed.py): over three steps, with the
    groups changing and an expert with no rows in some, every out, dx, dw and every expert's
    history and scales equal a dense delayed Float8LinearFn run on that expert's rows with its own
    state, bit for bit (fp64 compute, as in the test above). Step 1 quantizes with scale 1, so
    the inputs are scaled to exceed e4m3's range there (saturation is part of the recipe)."""
    from fsdp8.fp8.grouped_delayed import DelayedExperts
    from fsdp8.fp8.recipes import DelayedState, update_delayed_states

    recipe = DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(len(SIZES), N, K, generator=g, dtype=torch.float64)
    experts = DelayedExperts.new(recipe, len(SIZES), "cpu")
    dense = [DelayedState(recipe, "cpu") for _ in SIZES]
    for step, sizes in enumerate([SIZES, [5, 0, 150, 3, 0, 40], SIZES]):
        x = torch.randn(sum(sizes), K, generator=g, dtype=torch.float64) * 300
        dy = torch.randn(sum(sizes), N, generator=g, dtype=torch.float64) * 1e-3
        xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fp8_grouped_mm(xg, wg, offsets(sizes), recipe, delayed=experts.local(0, len(sizes)))
        got = (out, *torch.autograd.grad(out, (xg, wg), dy))
        if any(s.dirty for s in dense):  # one roll for all experts a step, a reached one or not (amax 0)
            update_delayed_states(dense)
        outs, dxs, dws, start = [], [], [], 0
        for e, rows in enumerate(sizes):
            xe = x[start:start + rows].clone().requires_grad_()
            we = weight[e].clone().requires_grad_()
            if rows:
                o = Float8LinearFn.apply(xe, we, None, recipe, dense[e])
                dx, dw = torch.autograd.grad(o, (xe, we), dy[start:start + rows])
                outs.append(o), dxs.append(dx), dws.append(dw)
            else:
                dws.append(torch.zeros_like(we))
            start += rows
        for a, b in zip(got, (torch.cat(outs), torch.cat(dxs), torch.stack(dws))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for e, state in enumerate(dense):
            torch.testing.assert_close(experts.pending[e], state.pending, rtol=0, atol=0, msg=f"step {step} expert {e}")
            torch.testing.assert_close(experts.history[e], state.history, rtol=0, atol=0)
            torch.testing.assert_close(experts.scale[e], state.scale, rtol=0, atol=0)
        assert step == 0 or experts.scale.ne(1).any()  # the histories moved the scales


def test_delayed_scaling_converts_experts_with_their_histories_as_buffers():
    model = Llama(preset("moe-tiny", n_layers=1))
    experts = model.layers[0].ffn.experts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_fp8(model, DelayedScaling(amax_history_len=8))
    kept = " ".join(str(w.message) for w in caught if issubclass(w.category, HighPrecisionLayerWarning))
    assert "router" in kept and "mixture-of-experts" not in kept, kept  # only the router stays behind
    assert isinstance(experts.fp8_recipe, DelayedScaling)
    count = experts.gate_up_proj.shape[0]
    buffers = {n: tuple(b.shape) for n, b in experts.named_buffers()}
    assert buffers == {f"fp8_{w}_{b}": shape for w in ("gate_up_proj", "down_proj")
                       for b, shape in (("amax_history", (count, 3, 8)), ("scale", (count, 3)),
                                        ("amax_pending", (count, 3)))}
    with pytest.raises(ValueError, match="delayed-scaling states"):
        fp8_grouped_mm(torch.randn(4, 16), torch.randn(2, 16, 16), offsets([1, 3]), DelayedScaling())
    # Trains standalone: each projection folds its amaxes in at its next forward; state dicts keep them.
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    for _ in range(3):
        model(tokens).float().pow(2).mean().backward()
    state = experts.fp8_delayed["down_proj"]
    assert state.history[:, :, :2].gt(0).any() and state.scale.ne(1).any()
    other = Llama(preset("moe-tiny", n_layers=1))
    convert_to_fp8(other, DelayedScaling(amax_history_len=8))
    other.load_state_dict(model.state_dict())
    loaded = other.layers[0].ffn.experts.fp8_delayed["down_proj"]
    torch.testing.assert_close(loaded.scale, state.scale, rtol=0, atol=0)
    torch.testing.assert_close(loaded.states[1].scale_inv_column, state.states[1].scale_inv_column, rtol=0, atol=0)


class LoopExperts(nn.Module):
    """Experts in transformers' layout whose forward is its own (not fsdp8's grouped GEMMs)."""

    def __init__(self, experts=2, dim=32, hidden=16):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.randn(experts, dim, hidden))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def test_experts_whose_forward_cannot_run_fp8_stay_in_high_precision_and_are_named():
    # A recipe on a module whose forward never reads it would be FP8 in name only.
    mixed = nn.ModuleDict({"own": LoopExperts(), "odd": moe.Experts(moe_config(hidden=24)),
                           "ok": moe.Experts(moe_config())})
    with pytest.warns(HighPrecisionLayerWarning) as caught:
        convert_to_fp8(mixed, Float8CurrentScaling())
    message = " ".join(str(w.message) for w in caught)
    assert "their forward does not compute the experts with fsdp8's FP8 grouped GEMMs" in message
    assert "own (gate_up_proj 2x32x32, down_proj 2x32x16)" in message
    assert "expert dimensions not multiples of 16" in message and "odd (gate_up_proj 4x48x32" in message
    assert [n for n, m in mixed.items() if getattr(m, "fp8_recipe", None) is not None] == ["ok"]


def moe_config(hidden=16):
    from fsdp8.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16,
                       num_experts=4, num_experts_per_tok=2, moe_ffn_dim=hidden)


# -- a converted MoE Llama trains --------------------------------------------------------------------
STEPS, LR = 4, 3e-3
# FP8 GEMMs in series from the embedding to the logits: per block q/k/v then wo, the experts'
# gate_up then down; then the head.
SERIAL_GEMMS = 2 * 4 + 1


def train(model, batch, spy=None):
    """Losses of STEPS AdamW steps on one batch (memorised: the loss falls), and the RMS of each
    step's logits centred per token (what cross entropy sees)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, logit_rms = [], []
    for _ in range(STEPS):
        with torch.no_grad():
            logits = model(batch[:, :-1]).double()
            logit_rms.append((logits - logits.mean(-1, keepdim=True)).square().mean().sqrt().item())
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        losses.append(loss.item())
        if spy is not None:
            spy(model)
        opt.step()
        opt.zero_grad()
    return losses, logit_rms


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()], ids=ids)
def test_a_converted_moe_llama_trains_close_to_fp32(recipe, monkeypatch):
    """The loss of each step within a bound of fp32's, from two first-order terms:

    - the forward's rounding at that step's parameters: a GEMM's RMS relative error is
      e_f = 1.5 sqrt(2 u_f**2 / 3) (test_fp8_linear), independent errors of SERIAL_GEMMS GEMMs add in
      quadrature, so the logits z move by sqrt(SERIAL_GEMMS) e_f rms(z) (RMS, centred); the mean
      cross entropy of T tokens moves by sum((p - y) dz) / T, whose RMS is at most
      sqrt(2 / T) |dz|_rms (|p - y|**2 sums to at most 2 per token); three standard deviations;
    - the updates computed from FP8 gradients (relative error up to e_b = 1.5 sqrt((u_f**2 + u_b**2)
      / 3)): each step's loss change is off by at most e_b of fp32's, and those add up."""
    torch.manual_seed(0)
    base = Llama(preset("moe-tiny", n_layers=2))
    batch = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    want, logit_rms = train(copy.deepcopy(base), batch)
    model = copy.deepcopy(base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_fp8(model, recipe)
    kept = " ".join(str(w.message) for w in caught if w.category is HighPrecisionLayerWarning)
    assert "router(s)" in kept and "ffn.experts" not in kept, kept
    calls = []
    monkeypatch.setattr(moe, "fp8_grouped_mm", lambda *a: calls.append(a[3]) or fp8_grouped_mm(*a))

    def expert_grads_are_finite_and_non_zero(m):
        grad = m.layers[1].ffn.experts.gate_up_proj.grad
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0

    got, _ = train(model, batch, expert_grads_are_finite_and_non_zero)
    # layers x GEMMs x forwards (logits, loss) x steps, all with the model's recipe
    assert len(calls) == 2 * 2 * 2 * STEPS and all(r is recipe for r in calls)
    u_f, u_b = UNIT_ROUNDOFF[recipe.fwd_dtype], UNIT_ROUNDOFF[recipe.bwd_dtype]
    e_f, e_b = 1.5 * math.sqrt(2 * u_f**2 / 3), 1.5 * math.sqrt((u_f**2 + u_b**2) / 3)
    tokens = batch[:, 1:].numel()
    assert want[-1] < want[0] - 1 and got[-1] < got[0] - 1  # it trains
    for step in range(STEPS):
        forward = 3 * math.sqrt(SERIAL_GEMMS) * e_f * logit_rms[step] * math.sqrt(2 / tokens)
        updates = e_b * sum(abs(want[j + 1] - want[j]) for j in range(step))
        assert abs(got[step] - want[step]) <= forward + updates, (step, got, want, forward, updates)


def test_fsdp8_train_start_up_line_counts_fp8_experts():
    from fsdp8.app.train.startup import _fp8_layers
    from fsdp8.models.llama import Llama, preset

    # convert_to_fp8 on the whole model: the head too (fully_shard converts inside its units only).
    model = fsdp8.convert_to_fp8(Llama(preset("moe-tiny", n_layers=2)), fsdp8.Float8CurrentScaling())
    assert _fp8_layers(model) == "9 linear layers and 2 experts modules run FP8 GEMMs; in bf16: layers.*.ffn.gate (Router)"


def test_delayed_experts_follow_their_buffers_when_the_module_moves():
    # The engine holds the states: a move (module.to / .double()) must rebind them, not replace them.
    model = Llama(preset("moe-tiny", n_layers=1))
    experts = model.layers[0].ffn.experts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HighPrecisionLayerWarning)
        convert_to_fp8(model, DelayedScaling(amax_history_len=8))
    held = experts.fp8_delayed["gate_up_proj"]
    states = list(held.states)
    experts.fp8_gate_up_proj_scale.fill_(2.0)
    model.double()  # replaces every floating buffer
    from fsdp8.fp8.grouped_delayed import delayed_experts

    again = delayed_experts(experts, "gate_up_proj")
    assert again is held and again.states == states  # the same objects
    assert again.scale is experts.fp8_gate_up_proj_scale and again.scale.dtype == torch.float64
    assert states[1].scale.data_ptr() == experts.fp8_gate_up_proj_scale[1].data_ptr()
    assert float(states[1].scale_inv_column[0]) == 0.5  # the kept inverses follow
