"""What a compiled block's FP8 graphs compute, op by op: each per-tensor scale is one
reduction, found once. A compiled step is host-bound when its graphs launch too many kernels
(docs/PERFORMANCE.md, 2026-11-26 fifth session), so these count reductions in the graphs
AOTAutograd hands to the compiler, split into forward and backward as Inductor splits them."""

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from fsdp8.fp8.convert import convert_to_fp8
from fsdp8.fp8.recipes import recipe_from_name

_AMAX_LIKE = {torch.ops.aten.amax.default, torch.ops.aten.amin.default, torch.ops.aten.aminmax.default,
              torch.ops.aten.max.default, torch.ops.aten.min.default}


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _graphs_of(model, x, partition_fn=min_cut_rematerialization_partition):
    """The forward and backward graphs of one compiled step of ``model`` on ``x``."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition_fn)
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    out.square().mean().backward()
    assert len(graphs) == 2, f"expected one forward and one backward graph, got {len(graphs)}"
    return graphs


def _reductions(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in _AMAX_LIKE]


def test_current_scaling_finds_each_scale_with_one_reduction_once():
    """Forward: one ``amax`` each for the two inputs and the two weights (no aminmax, which
    Inductor splits into a min and a max reduction). Backward: one each for the two output
    gradients; the inputs' transposes reuse the scales found in forward."""
    torch.manual_seed(0)
    model = convert_to_fp8(_MLP(), recipe_from_name("fp8-current"))
    x = torch.randn(2, 16, 64, requires_grad=True)
    forward, backward = _graphs_of(model, x)
    assert _reductions(forward) == [torch.ops.aten.amax.default] * 4, forward.graph
    assert _reductions(backward) == [torch.ops.aten.amax.default] * 2, backward.graph


@pytest.mark.parametrize("recipe_name", ["fp8-current", "fp8-block"])
def test_compiled_weight_gradients_match_eager_with_the_saved_scale(recipe_name):
    """The backward's input transpose quantized with the forward's saved scale gives eager's
    weight gradients (eager quantizes both ways in forward). fp64 compute: the compiled graph
    orders some fp64 sums otherwise (the bias gradient differs by ~4e-16 relative), so the
    bound is 1e-12; another scale would change FP8 bytes, an error near 1e-2."""
    torch.manual_seed(0)
    eager, compiled = _MLP().double(), _MLP().double()
    compiled.load_state_dict(eager.state_dict())
    recipe = recipe_from_name(recipe_name)
    convert_to_fp8(eager, recipe)
    convert_to_fp8(compiled, recipe)
    x = torch.randn(2, 128, 64, dtype=torch.float64)
    grads = []
    for model, run in ((eager, eager), (compiled, torch.compile(compiled, fullgraph=True))):
        torch._dynamo.reset()
        run(x).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(grads[1], grads[0]):
        assert (got - want).norm() <= 1e-12 * want.norm()


def _inductor_graph_targets(model, x) -> list:
    """The op targets of each graph Inductor compiles for one step of ``model`` (post-grad:
    AOTAutograd's forward and backward graphs after Inductor's own passes)."""
    import torch._inductor.config as inductor_config

    graphs = []
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=lambda g: graphs.append(
            [n.target for n in g.nodes if n.op == "call_function"])):
        torch.compile(model, fullgraph=True)(x).square().mean().backward()
    assert len(graphs) == 2, f"expected one forward and one backward graph, got {len(graphs)}"
    return graphs


def test_delayed_scaling_reads_the_kept_scale_inverses():
    """Delayed scaling (states updated outside, as under the engine) computes no scale inverse
    in its compiled graphs: it reads the ones its states keep, so no one-element kernel per
    quantization. Its amaxes: x's and both weights' in forward (x of ``down`` is relu's
    output), the output gradients' in backward."""
    torch.manual_seed(0)
    model = convert_to_fp8(_MLP(), recipe_from_name("fp8-delayed"))
    for m in model.modules():
        if hasattr(m, "external_delayed_update"):
            m.external_delayed_update = True
    forward, backward = _inductor_graph_targets(model, torch.randn(2, 16, 64, requires_grad=True))
    for targets in (forward, backward):
        assert torch.ops.aten.reciprocal.default not in targets, targets
    assert [t for t in forward if t in _AMAX_LIKE] == [torch.ops.aten.amax.default] * 4, forward
    assert [t for t in backward if t in _AMAX_LIKE] == [torch.ops.aten.amax.default] * 2, backward
