"""Clear errors for bad input (single process; the group of one is started on demand)."""

import pytest
import torch
import torch.nn as nn

import fsdp8
from tests.dist.common import UnevenModel


def model():
    torch.manual_seed(0)
    return UnevenModel(vocab=9)


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        fsdp8.fully_shard(model(), strategy="zero3")


def test_units_matching_nothing():
    with pytest.raises(ValueError, match="matches no submodule of UnevenModel"):
        fsdp8.fully_shard(model(), units=[nn.Conv2d])
    with pytest.raises(ValueError, match="matches no submodule"):
        fsdp8.fully_shard(model(), units=lambda name, m: False)
    with pytest.raises(TypeError, match="units must be nn.Module classes"):
        fsdp8.fully_shard(model(), units=[int])


def test_outer_strategy_needs_2d_mesh():
    with pytest.raises(ValueError, match="outer_strategy='optim' needs a 2-D"):
        fsdp8.fully_shard(model(), outer_strategy="optim")
    fsdp8.init_distributed()
    mesh = fsdp8.make_mesh()
    with pytest.raises(ValueError, match="got a 1-D mesh"):
        fsdp8.fully_shard(model(), mesh=mesh, outer_strategy="optim")


def test_wrapping_twice():
    m = fsdp8.fully_shard(model())
    with pytest.raises(RuntimeError, match="already sharded"):
        fsdp8.fully_shard(m)


def test_shared_across_units():
    m = model()
    m.blocks[1].up.weight = m.blocks[0].up.weight
    with pytest.raises(ValueError, match="shared by units 'blocks.0', 'blocks.1'"):
        fsdp8.fully_shard(m)


class MetaBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.empty(4, device="meta"))

    def forward(self, x):
        return self.lin(x) + self.table


def test_forward_with_meta_leftovers():
    m = fsdp8.fully_shard(MetaBuffer())
    with pytest.raises(RuntimeError, match="table are still on the meta device"):
        m(torch.randn(2, 4))


def test_meta_params_without_reset():
    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(ValueError, match="NoReset has parameters on the meta device but no reset_parameters"):
        fsdp8.fully_shard(NoReset())


def test_bad_types():
    with pytest.raises(TypeError, match="precision must be fsdp8.Precision"):
        fsdp8.fully_shard(model(), precision=torch.bfloat16)
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fsdp8.fully_shard(torch.zeros(3))
    with pytest.raises(ValueError, match="0-dimensional"):
        m = nn.Linear(2, 2)
        m.s = nn.Parameter(torch.tensor(1.0))
        fsdp8.fully_shard(m)


def test_load_state_dict_assign_refused():
    m = fsdp8.fully_shard(model())
    with pytest.raises(ValueError, match="assign=True"):
        m.load_state_dict(m.state_dict(), assign=True)


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 = 2, but the world has 1 ranks"):
        fsdp8.make_mesh(dp_replicate=2, dp_shard=1)
    with pytest.raises(ValueError, match="the given sizes multiply to 2, which does not divide the world of 1"):
        fsdp8.make_mesh(tp=2)


class _NoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.LayerNorm(16), nn.LayerNorm(16)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def test_fp8_that_converts_nothing_says_so():
    with pytest.warns(UserWarning, match="no layer of _NoLinears runs in FP8"):
        fsdp8.fully_shard(_NoLinears(), fp8=fsdp8.Float8CurrentScaling())


def test_offload_with_fp8_is_refused():
    with pytest.raises(NotImplementedError, match="offload='optim' with FP8"):
        fsdp8.fully_shard(model(), fp8=fsdp8.Float8CurrentScaling(), offload="optim")
    with pytest.raises(ValueError, match="offload='gpu'"):
        fsdp8.fully_shard(model(), offload="gpu")
