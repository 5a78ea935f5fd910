"""All experts' FP8 GEMMs in one grouped kernel (fsdp8/fp8/grouped_kernel.py), single process on
CPU through the kernel's emulation: the layouts, scales and padded weight-gradient buffer it is fed
give what the group-by-group path gives, without reading the group sizes on the host."""

import warnings

import pytest
import torch

from fsdp8.fp8 import grouped_kernel
from fsdp8.fp8.formats import E4M3, E5M2, Granularity
from fsdp8.fp8.grouped import fp8_grouped_mm, grouped_weights
from fsdp8.fp8.grouped_kernel import Groups
from fsdp8.fp8.recipes import Float8CurrentScaling
from fsdp8.fp8.tensor import Float8Tensor

# Empty groups first, in the middle and last; groups of 1, 17 and 150 rows (none a multiple of 16).
SIZES, K, N = [0, 150, 1, 0, 17, 0], 160, 48
RECIPES = [Float8CurrentScaling(fp8_format="e4m3"), Float8CurrentScaling()]  # backward in the kernel; group by group


def offsets(sizes) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SIZES), K, generator=g).bfloat16()
    w = (torch.randn(len(SIZES), N, K, generator=g) * torch.logspace(-2, 1, len(SIZES))[:, None, None]).bfloat16()
    dy = torch.randn(sum(SIZES), N, generator=g).bfloat16()
    return x, w, dy


def gathered(w: torch.Tensor, recipe) -> Float8Tensor:
    """``w`` as the engine hands a gathered FP8 experts weight over: its bytes and per-expert scales."""
    parts = grouped_weights(w, recipe.fwd_dtype, Granularity.TENSOR)
    return Float8Tensor(torch.stack([q.data for q in parts]), torch.stack([q.scale_inv for q in parts]),
                        Granularity.TENSOR, w.dtype)


def run(x, w, dy, recipe, one_kernel: bool, monkeypatch, groups=None):
    monkeypatch.setattr(grouped_kernel, "kernel_runs", lambda device: one_kernel)
    x = x.clone().requires_grad_()
    w = w if isinstance(w, Float8Tensor) else w.clone().requires_grad_()
    out = fp8_grouped_mm(x, w, groups.offs if groups is not None else offsets(SIZES), recipe, groups)
    if isinstance(w, Float8Tensor):
        return out, torch.autograd.grad(out, x, dy)[0]
    return (out, *torch.autograd.grad(out, (x, w), dy))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.fp8_format)
@pytest.mark.parametrize("weight", ["high-precision", "gathered"])
def test_one_kernel_gives_the_group_by_group_results(recipe, weight, monkeypatch):
    x, w, dy = operands()
    if weight == "gathered":
        w = gathered(w, recipe)
    want = run(x, w, dy, recipe, False, monkeypatch)
    got = run(x, w, dy, recipe, True, monkeypatch)
    # The same FP8 bytes and scales both ways, each product exact in fp32; only the order of the
    # fp32 sums may differ, so a bf16 result is the same value or one bf16 step (2**-8) away.
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -8, atol=0)
    assert (got[0] != 0).any() and (got[-1] != 0).any()  # not vacuously equal


def test_hybrid_gradients_say_once_that_the_backward_goes_expert_by_expert(monkeypatch):
    from fsdp8.fp8 import grouped

    monkeypatch.setattr(grouped, "_WARNED_HYBRID", [])
    x, w, dy = operands()
    with pytest.warns(RuntimeWarning, match="fp8_format='e4m3'"):
        run(x, w, dy, Float8CurrentScaling(), True, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process; e4m3 and the group-by-group path say nothing
        run(x, w, dy, Float8CurrentScaling(), True, monkeypatch)
        run(x, w, dy, Float8CurrentScaling(fp8_format="e4m3"), True, monkeypatch)
    monkeypatch.setattr(grouped, "_WARNED_HYBRID", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(x, w, dy, Float8CurrentScaling(), False, monkeypatch)


def test_one_kernel_reads_no_group_sizes_on_the_host(monkeypatch):
    x, w, dy = operands()
    reads = []

    class Counted(Groups):
        def bounds(self):
            if self._bounds is None:  # a read of the device's offsets on the host
                reads.append(1)
            return super().bounds()

    run(x, w, dy, Float8CurrentScaling(fp8_format="e4m3"), True, monkeypatch, Counted(offsets(SIZES)))
    assert reads == []
    run(x, w, dy, Float8CurrentScaling(), True, monkeypatch, Counted(offsets(SIZES)))  # e5m2 gradients
    assert len(reads) == 1  # the backward, group by group
    run(x, w, dy, Float8CurrentScaling(), False, monkeypatch, Counted(offsets(SIZES)))
    assert len(reads) == 2  # group by group: one read, in the forward, shared with the backward


def test_three_gemms_are_the_dequantized_products():
    x, w, dy = operands(1)
    offs = offsets(SIZES)
    out, dx, dw = grouped_kernel.three_gemms(x, w, dy, offs)
    groups = Groups(offs)
    qx, qdy = grouped_kernel.quantize_groups(x, E4M3, groups), grouped_kernel.quantize_groups(dy, E4M3, groups)
    qw, inv_w = grouped_kernel.quantize_experts(w, E4M3)
    group = groups.row_group(x.shape[0])
    xd, dyd = qx.data.float() * qx.inv[group][:, None], qdy.data.float() * qdy.inv[group][:, None]
    wd = qw.float() * inv_w[:, None, None]
    bounds = list(zip([0] + offs.tolist()[:-1], offs.tolist()))
    want_out = torch.cat([xd[a:b] @ wd[g].t() for g, (a, b) in enumerate(bounds)])
    want_dx = torch.cat([dyd[a:b] @ wd[g] for g, (a, b) in enumerate(bounds)])
    want_dw = torch.stack([dyd[a:b].t() @ xd[a:b] for a, b in bounds])
    for got, want in ((out, want_out), (dx, want_dx), (dw, want_dw)):
        torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2 ** -8, atol=0)
    assert (dw[[0, 3, 5]] == 0).all() and (dw[[1, 2, 4]] != 0).any()  # empty groups get no gradient


def test_weight_gradient_buffer_starts_every_group_on_16_tokens():
    sizes = [0, 17, 1, 0, 16, 3]
    groups = Groups(offsets(sizes))
    column, ends, width = groups.padded(sum(sizes))
    # Group starts 0, 0, 32, 48, 48, 64: rows keep their order within their group.
    assert column.tolist() == list(range(0, 17)) + [32] + list(range(48, 64)) + [64, 65, 66]
    assert width == 128  # 37 + 6 * 15, up to 16
    assert ends.tolist() == [0, 32, 48, 48, 64, width]  # the last group takes the zero tail
    q = torch.randn(sum(sizes), 16).to(E4M3)
    padded = grouped_kernel.quantize_groups(q.float(), E4M3, groups, padded=True).padded_t
    assert padded.shape == (16, 128) and (padded.view(torch.uint8)[:, 17:32] == 0).all()
    assert groups.padded(sum(sizes))[0] is column  # derived once, then shared
    source = groups.sources(sum(sizes))  # the columns' rows, as the Triton cast reads them
    assert source.dtype == torch.int32 and source.shape == (width,)
    assert source[column].tolist() == list(range(sum(sizes)))
    assert (source >= 0).sum().item() == sum(sizes) and (source[17:32] == -1).all()


def test_the_emulated_kernel_refuses_what_the_kernel_refuses():
    a = torch.zeros(32, 32).to(E4M3)
    b = torch.zeros(2, 16, 32).to(E4M3).transpose(1, 2)  # [2, 32, 16], column-major
    offs = torch.tensor([10, 32], dtype=torch.int32)
    scale_a, scale_b = torch.ones(32), torch.ones(2, 16)
    assert grouped_kernel.scaled_grouped_mm(a, b, scale_a, scale_b, offs).shape == (32, 16)
    with pytest.raises(ValueError, match="column-major"):
        grouped_kernel.scaled_grouped_mm(a, b.contiguous(), scale_a, scale_b, offs)
    with pytest.raises(ValueError, match="e4m3"):
        grouped_kernel.scaled_grouped_mm(a.float().to(E5M2), b, scale_a, scale_b, offs)
    with pytest.raises(ValueError, match="scales"):
        grouped_kernel.scaled_grouped_mm(a, b, scale_a, torch.ones(2, 32), offs)
    with pytest.raises(ValueError, match="int32"):
        grouped_kernel.scaled_grouped_mm(a, b, scale_a, scale_b, offs.long())


def test_the_kernel_is_not_used_off_cuda():
    assert not grouped_kernel.kernel_runs(torch.device("cpu"))


def test_the_emulated_kernel_refuses_unaligned_token_groups_and_offsets_past_the_rows():
    a = torch.zeros(16, 48).to(E4M3)  # [N, tokens], row-major
    b = torch.zeros(32, 48).to(E4M3).t()  # [tokens, K], column-major
    scale_a, scale_b = torch.ones(2 * 16), torch.ones(2 * 32)
    assert grouped_kernel.scaled_grouped_mm(a, b, scale_a, scale_b, torch.tensor([16, 48], dtype=torch.int32)).shape == (2, 16, 32)
    with pytest.raises(ValueError, match="multiple of 16"):  # what weight_grad_gemm's padding exists for
        grouped_kernel.scaled_grouped_mm(a, b, scale_a, scale_b, torch.tensor([7, 48], dtype=torch.int32))
    with pytest.raises(ValueError, match="end within"):
        grouped_kernel.scaled_grouped_mm(a, b, scale_a, scale_b, torch.tensor([16, 64], dtype=torch.int32))


def test_without_grad_no_buffer_is_made_and_nothing_is_said(monkeypatch):
    from fsdp8.fp8 import grouped

    made = []  # each quantization's padded flag (the weight's and the input's)
    original = grouped_kernel.quantize_groups
    monkeypatch.setattr(grouped_kernel, "quantize_groups",
                        lambda *a, **kw: made.append(kw.get("padded", False)) or original(*a, **kw))
    monkeypatch.setattr(grouped, "_WARNED_HYBRID", [])
    monkeypatch.setattr(grouped_kernel, "kernel_runs", lambda device: True)
    x, w, _ = operands()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fp8_grouped_mm(x, w.requires_grad_(), offsets(SIZES), Float8CurrentScaling())
    assert made == [False, False] and out.shape == (sum(SIZES), N)


def test_the_kernel_path_takes_a_transposed_weight_view_and_leaves_int64_offsets_to_the_group_path(monkeypatch):
    x, w, dy = operands()
    recipe = Float8CurrentScaling(fp8_format="e4m3")
    want = run(x, w, dy, recipe, False, monkeypatch)
    strided = w.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, not contiguous
    got = run(x, strided, dy, recipe, True, monkeypatch)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -8, atol=0)
    monkeypatch.setattr(grouped_kernel, "kernel_runs", lambda device: True)
    from fsdp8.fp8.grouped import one_kernel

    assert one_kernel(x, w, offsets(SIZES), recipe) and not one_kernel(x, w, offsets(SIZES).long(), recipe)


def test_a_layers_two_projections_derive_their_groups_once(monkeypatch):
    """expert_mlp's two FP8 GEMMs and their backward share one Groups: each row's group and the
    padded token buffer's columns are found once per layer, not once per quantization (four)."""
    import torch.nn.functional as F

    from fsdp8.models.moe import expert_mlp

    monkeypatch.setattr(grouped_kernel, "kernel_runs", lambda device: True)
    found = []
    original = grouped_kernel.group_of_rows
    monkeypatch.setattr(grouped_kernel, "group_of_rows", lambda offs, rows: found.append(rows) or original(offs, rows))
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor(SIZES)
    x = torch.randn(sum(SIZES), 32, generator=g).bfloat16().requires_grad_()
    gate_up = torch.randn(len(SIZES), 64, 32, generator=g).bfloat16().requires_grad_()
    down = torch.randn(len(SIZES), 32, 32, generator=g).bfloat16().requires_grad_()
    out = expert_mlp(x, counts, gate_up, down, F.silu, Float8CurrentScaling(fp8_format="e4m3"))
    out.float().square().sum().backward()
    # The routed rows' groups once; each high-precision weight's experts (quantize_experts) once each.
    assert sorted(found) == sorted([sum(SIZES), 6 * 64, 6 * 32]), found
    assert gate_up.grad.abs().sum() > 0 and down.grad.abs().sum() > 0


def test_the_kernel_is_probed_before_compiling_only_for_fp8_experts_on_a_gpu(monkeypatch):
    """parallelize runs the probe before it compiles the units (a probe met inside a trace would
    split the graph): for a model with FP8 experts on a CUDA device, not otherwise."""
    from fsdp8.fp8 import grouped
    from fsdp8.fp8.convert import convert_to_fp8
    from fsdp8.models.llama import Llama, preset

    probed = []
    monkeypatch.setattr(grouped_kernel, "kernel_runs", lambda device: probed.append(device) or True)
    moe = convert_to_fp8(Llama(preset("moe-tiny", n_layers=1)), Float8CurrentScaling(fp8_format="e4m3"))
    dense = convert_to_fp8(Llama(preset("tiny", n_layers=1)), Float8CurrentScaling(fp8_format="e4m3"))
    grouped.probe_before_compiling(moe, torch.device("cpu"))
    grouped.probe_before_compiling(dense, torch.device("cuda", 0))
    assert probed == []
    grouped.probe_before_compiling(moe, torch.device("cuda", 0))
    assert probed == [torch.device("cuda", 0)]


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_delayed_experts_in_one_kernel_give_the_group_by_group_results(fp8_format, monkeypatch):
    # Delayed scaling through the grouped kernel (its backward too with e4m3 gradients): the same
    # results as the group-by-group path within one bf16 step (the order of fp32 sums), and the
    # same amaxes recorded, bit for bit, over two steps whose second reads the histories' scales.
    from fsdp8.fp8.grouped_delayed import DelayedExperts
    from fsdp8.fp8.recipes import DelayedScaling, update_delayed_states

    recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=4)
    states = {kernel: DelayedExperts.new(recipe, len(SIZES), "cpu") for kernel in (False, True)}
    results, launches, kernel_gemm = {}, [], grouped_kernel.scaled_grouped_mm
    monkeypatch.setattr(grouped_kernel, "scaled_grouped_mm", lambda *a, **k: launches.append(1) or kernel_gemm(*a, **k))
    for step in range(2):
        x, w, dy = operands(seed=step)
        for kernel, experts in states.items():
            monkeypatch.setattr(grouped_kernel, "kernel_runs", lambda device: kernel)
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = fp8_grouped_mm(xg, wg, offsets(SIZES), recipe, delayed=experts.local(0, len(SIZES)))
            results[kernel] = (out, *torch.autograd.grad(out, (xg, wg), dy))
            update_delayed_states(experts.states)
        for a, b in zip(results[True], results[False]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -8, atol=0)
        for name in ("history", "scale", "pending"):
            torch.testing.assert_close(getattr(states[True], name), getattr(states[False], name), rtol=0, atol=0)
    assert states[True].scale.ne(1).any() and (results[True][0] != 0).any()  # scales moved; not vacuous
    # The kernel ran: each step's forward, and with e4m3 gradients its two backward GEMMs.
    assert len(launches) == 2 * (3 if fp8_format == "e4m3" else 1)
