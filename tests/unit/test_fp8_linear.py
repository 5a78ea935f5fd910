"""The FP8 linear (single process, CPU): exact against an emulated reference, close to bf16,
the recipes' state (delayed histories), conversion, and the linear under torch.compile."""

import math
import warnings

import pytest
import torch
import torch.nn as nn

from fsdp8.fp8.convert import convert_to_fp8
from fsdp8.fp8.formats import E4M3, Granularity, scale_to_inv
from fsdp8.fp8.kernels import Quantized, amax, quantize
from fsdp8.fp8.linear import Float8Linear
from fsdp8.fp8.recipes import (
    DelayedScaling, DelayedState, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, recipe_from_name,
    update_delayed_states,
)
from fsdp8.fp8.tensor import Float8Tensor
from tests.unit.test_fp8 import UNIT_ROUNDOFF

RECIPES = [Float8CurrentScaling(), DelayedScaling(amax_history_len=8), Float8BlockScaling(), MXFP8BlockScaling(),
           Float8CurrentScaling(fp8_format="e4m3")]


def _emulated_reference(x, w, b, dy, recipe, state=None):
    """Out, dx, dw from explicitly quantized operands and fp32 matmuls (the emulation's)."""
    xg, wg, gg = recipe.x_granularity, recipe.w_granularity, recipe.g_granularity
    f, bw = recipe.fwd_dtype, recipe.bwd_dtype

    def q(t, dtype, g, row):
        if state is not None:
            return quantize(t, dtype, g, scale=state.scale[row])
        return quantize(t, dtype, g)

    qx, qxt = q(x, f, xg, 0), q(x.t().contiguous(), f, xg, 0)
    qw = q(w, f, wg, 1)
    qwt = (quantize(qw.dequantize().t().contiguous(), f, wg) if wg is Granularity.MX_1x32 else qw.t().contiguous())
    qdy, qdyt = q(dy, bw, gg, 2), q(dy.t().contiguous(), bw, gg, 2)
    deq = lambda t: t.dequantize(torch.float32)  # noqa: E731
    out = (deq(qx) @ deq(qw).t()).to(x.dtype) + b
    dx = (deq(qdy) @ deq(qwt).t()).to(x.dtype)
    dw = (deq(qdyt) @ deq(qxt).t()).to(x.dtype)
    return out, dx, dw


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.fp8_format}")
def test_float8_linear_equals_emulated_reference_exactly(recipe):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).to(torch.bfloat16)
    convert_to_fp8(lin, recipe)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 128, dtype=torch.bfloat16)
    state = lin.delayed_state(x.device)
    if state is not None:  # give delayed scaling a non-trivial history first
        lin(x.detach()).backward(dy)
        lin.zero_grad(set_to_none=True)
        state.update()
        scales = state.scale.clone()
    out = lin(x)
    out.backward(dy)
    ref_state = None
    if state is not None:
        ref_state = DelayedState(recipe, x.device)
        ref_state.scale = scales
    ref_out, ref_dx, ref_dw = _emulated_reference(x.detach(), lin.weight.detach(), lin.bias.detach(), dy, recipe, ref_state)
    assert torch.equal(out, ref_out)
    assert torch.equal(x.grad, ref_dx)
    assert torch.equal(lin.weight.grad, ref_dw)
    assert torch.equal(lin.bias.grad, dy.float().sum(0).to(torch.bfloat16))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.fp8_format}")
def test_float8_linear_close_to_bf16_linear(recipe):
    """For operands with independent relative rounding errors uniform in [-u, u], a dot
    product's relative error has RMS sqrt((u_a**2 + u_b**2) / 3); allow 1.5x that."""
    torch.manual_seed(0)
    ref = nn.Linear(512, 256).to(torch.bfloat16)
    lin = nn.Linear(512, 256).to(torch.bfloat16)
    lin.load_state_dict(ref.state_dict())
    convert_to_fp8(lin, recipe)
    x = torch.randn(128, 512, dtype=torch.bfloat16)
    dy = torch.randn(128, 256, dtype=torch.bfloat16)
    outs = []
    for module in (ref, lin):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(dy)
        outs.append((y, xi.grad, module.weight.grad))
    u_f, u_b = UNIT_ROUNDOFF[recipe.fwd_dtype], UNIT_ROUNDOFF[recipe.bwd_dtype]
    bound_fwd = 1.5 * math.sqrt(2 * u_f**2 / 3)
    bound_bwd = 1.5 * math.sqrt((u_f**2 + u_b**2) / 3)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    assert rel(y1, y0) <= bound_fwd
    assert rel(dx1, dx0) <= bound_bwd
    assert rel(dw1, dw0) <= bound_bwd


def test_delayed_history_rolls_and_reduces():
    recipe = DelayedScaling(amax_history_len=3, margin=1)
    state = DelayedState(recipe, torch.device("cpu"))
    for amax in (1.0, 4.0, 2.0, 0.5):
        state.record(0, torch.tensor(amax))
        state.update()
    assert state.history[0].tolist() == [0.5, 2.0, 4.0]  # newest first; the 1.0 rolled out
    assert state.scale[0].item() == 448.0 / 4.0 / 2  # max of the history, margin 1
    most_recent = DelayedState(DelayedScaling(amax_history_len=3, amax_compute="most_recent"), torch.device("cpu"))
    most_recent.record(2, torch.tensor(8.0))
    most_recent.update()
    assert most_recent.scale[2].item() == 57344.0 / 8.0  # hybrid: gradients in e5m2
    a, b = DelayedState(recipe, torch.device("cpu")), DelayedState(recipe, torch.device("cpu"))
    a.record(1, torch.tensor(3.0))
    b.record(1, torch.tensor(5.0))
    update_delayed_states([a, b])
    assert a.history[1, 0].item() == 3.0 and b.history[1, 0].item() == 5.0 and not a.dirty


def test_recipe_validation():
    with pytest.raises(ValueError, match="fp8_format='e5m2'"):
        Float8CurrentScaling(fp8_format="e5m2")
    with pytest.raises(ValueError, match="use one of 'e4m3'"):
        Float8BlockScaling(fp8_format="hybrid")
    with pytest.raises(ValueError, match="amax_compute"):
        DelayedScaling(amax_compute="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)


def test_convert_to_fp8_filters_and_keeps_parameters():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.Linear(10, 32))
    weight = model[0].weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert convert_to_fp8(model, Float8CurrentScaling()) is model
    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == ["0"]
    assert len(caught) == 1 and "2 linear layer(s)" in str(caught[0].message) and "2 (64x10)" in str(caught[0].message)
    assert isinstance(model[0], Float8Linear) and model[0].weight is weight
    assert not isinstance(model[2], Float8Linear)
    untouched = convert_to_fp8(nn.Sequential(nn.Linear(32, 64)), Float8CurrentScaling(), filter=lambda n, m: False)
    assert not any(isinstance(m, Float8Linear) for m in untouched.modules())
    lone = nn.Linear(32, 64)
    assert convert_to_fp8(lone, Float8CurrentScaling()) is lone and isinstance(lone, Float8Linear)
    with pytest.raises(TypeError, match="recipe must be an fsdp8 FP8 recipe"):
        convert_to_fp8(model, "current")


def test_float8_tensor_behaves_like_its_dequantized_value():
    x = torch.randn(16, 32)
    q = quantize(x, E4M3, Granularity.TENSOR)
    t = Float8Tensor(q.data, q.scale_inv, Granularity.TENSOR, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (16, 32)
    assert isinstance(t.detach(), Float8Tensor)
    assert torch.equal(t + 1, q.dequantize(torch.bfloat16) + 1)
    assert torch.equal(t.transposed().data.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
    assert isinstance(Quantized(q.data, q.scale_inv, Granularity.TENSOR).nbytes, int)


def test_linears_on_one_input_share_its_quantization_and_save_fp8_only():
    """q/k/v-style linears fed the same tensor quantize it once; what each saves for
    backward is FP8 (the input's transpose) plus the weight, never a bf16 input copy."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 32, bias=False).to(torch.bfloat16) for _ in range(3)]
    for layer in layers:
        convert_to_fp8(layer, Float8CurrentScaling())
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    outs = [layer(x) for layer in layers]
    saved = [out.grad_fn.qx_t for out in outs]  # the autograd node is the Function's ctx
    assert saved[0] is saved[1] is saved[2]  # one quantization of x, shared
    assert saved[0].data.dtype == torch.float8_e4m3fn and saved[0].shape == (64, 16)
    ctx_tensors = [v for v in vars(outs[0].grad_fn).values() if isinstance(v, torch.Tensor)]
    assert not any(t.dtype == torch.bfloat16 and t.numel() == x.numel() for t in ctx_tensors)
    # Sharing changes nothing numerically: a fresh input with the same values gives the same out.
    assert torch.equal(layers[2](x.detach().clone()), outs[2])
    sum(o.float().sum() for o in outs).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _grads_after(model, forward, x):
    x = x.clone().requires_grad_(True)
    out = forward(x)
    out.square().mean().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads


def _two_linears(recipe=None):
    torch.manual_seed(0)
    model = _TwoLinears()
    if recipe is not None:
        convert_to_fp8(model, recipe)
    return model


@pytest.mark.parametrize("recipe_name", ["fp8-current", "fp8-block", "fp8-delayed", "fp8-mxfp8"])
def test_float8_linear_under_torch_compile(recipe_name):
    """Traced linears (current, block and MX scaling) compile into one graph (fullgraph) and
    match eager; standalone delayed scaling (which updates its state at each forward) stays an
    opaque call inside the compiled block and still matches. fp32 compute: the
    compiler quantizes the same values with the same formulas, so the bound is fp32 reordering (1e-6)."""
    recipe = recipe_from_name(recipe_name)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    eager_model, compiled_model = _two_linears(recipe), _two_linears(recipe)
    traced = all(m.traced() for m in compiled_model.modules() if isinstance(m, Float8Linear))
    assert traced == (recipe.traceable and not recipe.delayed)
    eager_out, eager_grads = _grads_after(eager_model, eager_model.forward, x)
    out, grads = _grads_after(compiled_model, torch.compile(compiled_model.forward, fullgraph=traced), x)
    assert (out - eager_out).norm() <= 1e-6 * eager_out.norm()
    for got, want in zip(grads, eager_grads):
        assert (got - want).norm() <= 1e-6 * want.norm()
    # And it is FP8: far from the unquantized layers' result.
    plain = _two_linears()
    plain_out, _ = _grads_after(plain, plain.forward, x)
    assert (out - plain_out).norm() > 1e-3 * plain_out.norm()


def test_delayed_scaling_traced_under_torch_compile():
    """Delayed scaling with its states updated between steps (as the engine does) compiles
    into one graph (fullgraph: a graph break fails) that reads the scale buffers and folds
    the amaxes of x and w (forward) and dy (backward) into the pending buffers in place.
    Over four steps (scales from the history from step 1 on) it gives eager's outputs, input
    gradients, pending amaxes, histories and scales bit for bit, and its weight and bias
    gradients within the bound of a reordered sum. fp64 compute, as in the engine's compiled
    tests: the FP8 bytes are equal, and the emulated GEMMs' fp64 products of dequantized FP8
    values are nearly exact. The weight and bias gradients are sums over the n = 64 rows,
    which the compiled code may order otherwise (it does on one AVX2 machine, not on the CI
    machine of earlier runs): each order of a sum of n products is within n u sum|a b| of
    the exact one (u = eps / 2; n - 1 additions and the products' rounding), so two are
    within n eps sum|a b| of each other; the dequantized operands are at most 1/8 (e5m2 dy)
    and 1/16 (e4m3 x) larger than dy and x, hence the factor 1.2 on sum|dy| |x|. The bias
    gradient's products are exact (dy times 1): (n - 1) eps sum|dy|."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recipe = DelayedScaling(amax_history_len=4)
    models = [_two_linears(recipe).double() for _ in range(2)]
    for model in models:
        for m in model.modules():
            if isinstance(m, Float8Linear):
                m.external_delayed_update = True
    eager, compiled = models
    forwards = (eager.forward, torch.compile(compiled.forward, fullgraph=True))
    inputs, dys = {}, {}  # eager's, per linear: what bounds its weight gradient
    for name in ("up", "down"):
        layer = getattr(eager, name)
        layer.register_forward_hook(lambda m, args, out, name=name: inputs.__setitem__(name, args[0].detach()))
        layer.register_full_backward_hook(lambda m, grad_in, grad_out, name=name: dys.__setitem__(name, grad_out[0]))

    def states(model):
        return [m.delayed_state(torch.device("cpu")) for m in model.modules() if isinstance(m, Float8Linear)]

    for step in range(4):
        x = torch.randn(2, 32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(step)) * (step + 1)
        runs = []
        for model, forward in zip(models, forwards):
            x_in = x.clone().requires_grad_(True)
            out = forward(x_in)
            out.square().mean().backward()
            runs.append((out.detach(), x_in.grad, {n: p.grad for n, p in model.named_parameters()},
                         torch.stack([s.pending for s in states(model)])))
            update_delayed_states(states(model))
            model.zero_grad(set_to_none=True)
        (want_out, want_dx, want_grads, want_pending), (out, dx, grads, pending) = runs
        assert torch.equal(out, want_out) and torch.equal(dx, want_dx) and torch.equal(pending, want_pending), step
        assert (pending > 0).all()  # every row recorded: x, w and dy
        eps = torch.finfo(torch.float64).eps
        for name, want in want_grads.items():
            layer, kind = name.split(".")
            dy = dys[layer].reshape(-1, dys[layer].shape[-1]).abs()
            if kind == "bias":
                bound = (dy.shape[0] - 1) * eps * dy.sum(0)
            else:
                bound = 1.2 * dy.shape[0] * eps * (dy.t() @ inputs[layer].reshape(dy.shape[0], -1).abs())
            assert ((grads[name] - want).abs() <= bound).all(), (step, name)
    for a, b in zip(states(eager), states(compiled)):
        assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale)
        assert a.scale.ne(1).all()  # scales came from the histories
    assert not torch._dynamo.utils.counters["graph_break"]


def _delayed_linear_after_a_step(seed):
    """A delayed-scaling linear updated from outside (as the engine does, so it compiles into
    the graph), after one step on data of a seed-dependent magnitude: its scales are not 1."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(64, 64)), recipe_from_name("fp8-delayed"))
    model[0].external_delayed_update = True
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)) * (1 + 10 * seed)
    model(x).sum().backward()
    update_delayed_states([model[0].delayed_state(x.device)])
    return model


@pytest.mark.parametrize("load", ["load_state_dict", "fsdp8.load"])
def test_a_loaded_delayed_state_reaches_the_compiled_linear(tmp_path, load):
    """A compiled linear dequantizes with the inverses its delayed state keeps beside the
    scales (gemm.kept_inverse). Loads write the scales in place, so the inverses must follow
    them, or the first compiled step after a resume would quantize with the loaded scales and
    dequantize with the old ones (it did, before Float8Linear._load_from_state_dict)."""
    import fsdp8

    source, target = _delayed_linear_after_a_step(1), _delayed_linear_after_a_step(0)
    assert not torch.equal(source[0].fp8_scale, target[0].fp8_scale)
    if load == "load_state_dict":
        target.load_state_dict(source.state_dict())
    else:
        fsdp8.save(str(tmp_path / "ckpt"), source)
        fsdp8.load(str(tmp_path / "ckpt"), target)
    state = target[0].delayed_state(torch.device("cpu"))
    assert torch.equal(state.scale_inv_column, scale_to_inv(state.scale))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(target, fullgraph=True)(x), torch.compile(source, fullgraph=True)(x))


def test_delayed_state_changed_between_compiled_forward_and_backward_raises():
    """A compiled block's backward folds dy's amax into the pending amaxes its forward left
    (see the note in Float8Linear.forward); a state update in between would be overwritten,
    so autograd's version check must refuse it rather than let the amaxes go wrong."""
    recipe = DelayedScaling(amax_history_len=4)
    model = _two_linears(recipe).double()
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in linears:
        m.external_delayed_update = True
    forward = torch.compile(model.forward, fullgraph=True)
    x = torch.randn(2, 32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    loss = forward(x).square().mean()
    update_delayed_states([m._delayed for m in linears])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("compute,margin", [("max", 0), ("most_recent", 1)])
def test_batched_delayed_update_equals_each_state_updated_alone(compute, margin):
    """recipes.update_states (every linear's history in a few launches) against
    DelayedState.update one by one: histories, scales and pending bit for bit over steps with
    zeros, infinities and a NaN among the amaxes."""
    from fsdp8.fp8.recipes import DelayedScaling, DelayedState, update_states

    recipe = DelayedScaling(amax_history_len=4, amax_compute=compute, margin=margin)
    alone = [DelayedState(recipe, torch.device("cpu")) for _ in range(5)]
    batched = [DelayedState(recipe, torch.device("cpu")) for _ in range(5)]
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        amaxes = torch.rand(5, 3, generator=g) * 10 ** torch.randint(-3, 4, (5, 3), generator=g)
        amaxes[step % 5, step % 3] = (0.0, float("inf"), float("nan"))[step % 3]
        for state, row in zip(alone, amaxes):
            state.pending.fill_(1.0)
            state.update(row)
        for state in batched:
            state.pending.fill_(1.0)
        scales = update_states(batched, amaxes)
        for a, b, row_scale in zip(alone, batched, scales):
            for name in ("history", "scale", "pending", "scale_inv_column"):  # bit patterns: NaN included
                assert torch.equal(getattr(a, name).view(torch.int32), getattr(b, name).view(torch.int32)), (step, name)
            assert torch.equal(row_scale, b.scale) and (a.steps, a.dirty) == (b.steps, b.dirty)
            # The kept inverses: the scales' (scale_to_inv), each where cuBLAS takes a scale.
            assert torch.equal(torch.stack(b.scale_inv), scale_to_inv(b.scale))
            assert all(inv.data_ptr() % 16 == 0 for inv in b.scale_inv)


def test_batched_delayed_update_with_several_recipes():
    """States of different recipes (history lengths, amax rules, margins) in one batch are
    updated in their own groups and their scales come back in the states' order."""
    from fsdp8.fp8.recipes import DelayedScaling, DelayedState, update_states

    recipes = [DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=8, amax_compute="most_recent", margin=1)]
    order = [0, 1, 0, 1, 0]
    alone = [DelayedState(recipes[i], torch.device("cpu")) for i in order]
    batched = [DelayedState(recipes[i], torch.device("cpu")) for i in order]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        amaxes = torch.rand(5, 3, generator=g) * 100
        for state, row in zip(alone, amaxes):
            state.update(row)
        scales = update_states(batched, amaxes)
        for a, b, row_scale in zip(alone, batched, scales):
            assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale) and torch.equal(row_scale, b.scale)


def test_outer_major_scale_grids_reach_the_gemm_without_a_copy():
    """fp8_mm hands cuBLAS 1x128 scales outer-dimension-major; a grid made so (as the Triton
    quantizations write theirs) passes through as it is, a row-major one is copied."""
    from fsdp8.fp8.gemm import _outer_major
    from fsdp8.fp8.triton_kernels import scale_blocks_outer_major

    grid = scale_blocks_outer_major(256, 3, torch.device("cpu"))
    assert grid.shape == (256, 3) and grid.stride() == (1, 256)
    assert _outer_major(grid).data_ptr() == grid.data_ptr()
    assert grid.t().contiguous().data_ptr() == grid.data_ptr()  # the weight-gradient GEMM's second operand
    row_major = torch.ones(256, 3)
    assert _outer_major(row_major).data_ptr() != row_major.data_ptr()
