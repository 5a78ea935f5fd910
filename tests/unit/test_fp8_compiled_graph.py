"""What a compiled block's FP8 graphs compute, op by op: each per-tensor scale is one
reduction, found once, and delayed scaling computes no scale inverse. A compiled step is
host-bound when its graphs launch too many kernels (docs/PERFORMANCE.md, 2026-11-26 fifth
session), so these read the forward and backward graphs Inductor compiles (after its own
passes). That compiled FP8 matches eager is test_fp8_linear.py's."""

import torch
import torch._inductor.config as inductor_config
import torch.nn as nn

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


def _compiled_graph_targets(recipe_name: str, external_delayed_update: bool = False):
    """The op targets of the forward and backward graphs Inductor compiles for one step of an
    FP8 ``_MLP`` (post-grad: AOTAutograd's graphs after Inductor's passes)."""
    torch.manual_seed(0)
    model = convert_to_fp8(_MLP(), recipe_from_name(recipe_name))
    for m in model.modules():
        if hasattr(m, "external_delayed_update"):
            m.external_delayed_update = external_delayed_update  # as the engine sets it
    graphs = []
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=lambda g: graphs.append(
            [n.target for n in g.nodes if n.op == "call_function"])):
        torch.compile(model, fullgraph=True)(torch.randn(2, 16, 64, requires_grad=True)).square().mean().backward()
    assert len(graphs) == 2, f"expected one forward and one backward graph, got {len(graphs)}"
    return graphs


def _reductions(targets) -> list:
    return [t for t in targets if t in _AMAX_LIKE]


def test_current_scaling_finds_each_scale_with_one_reduction_once():
    """Forward: one ``amax`` each for the two inputs and the two weights (no aminmax, which
    Inductor splits into a min and a max reduction). Backward: one each for the two output
    gradients; the inputs' transposes reuse the scales found in forward."""
    forward, backward = _compiled_graph_targets("fp8-current")
    assert _reductions(forward) == [torch.ops.aten.amax.default] * 4, forward
    assert _reductions(backward) == [torch.ops.aten.amax.default] * 2, backward


def test_delayed_scaling_reads_the_kept_scale_inverses():
    """Delayed scaling (states updated outside, as under the engine) computes no scale inverse
    in its compiled graphs: it reads the ones its states keep, so no one-element kernel per
    quantization. Its amaxes, recorded for the next step: x's and both weights' in forward
    (x of ``down`` is relu's output), the output gradients' in backward."""
    forward, backward = _compiled_graph_targets("fp8-delayed", external_delayed_update=True)
    for targets in (forward, backward):
        assert torch.ops.aten.reciprocal.default not in targets, targets
    assert _reductions(forward) == [torch.ops.aten.amax.default] * 4, forward
    assert _reductions(backward) == [torch.ops.aten.amax.default] * 2, backward
