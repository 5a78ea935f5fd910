"""The world mesh's arithmetic (sizes, inference, flattened views) without processes."""

import math

import pytest

from fsdp8.distributed.mesh import flattened_dims, mesh_dims


@pytest.mark.parametrize(
    "world, kwargs, expected",
    [
        (8, {}, {"dp_shard": 8}),
        (8, {"dp_replicate": 2}, {"dp_replicate": 2, "dp_shard": 4}),
        (8, {"tp": 2}, {"dp_shard": 4, "tp": 2}),
        (8, {"dp_replicate": 2, "tp": 2}, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),
        (8, {"cp": 2, "tp": 2}, {"dp_shard": 2, "cp": 2, "tp": 2}),
        (4, {"dp_shard": 1, "tp": -1}, {"dp_shard": 1, "tp": 4}),
        (8, {"dp_replicate": -1, "dp_shard": 2}, {"dp_replicate": 4, "dp_shard": 2}),
        (6, {"dp_shard": 2, "cp": -1}, {"dp_shard": 2, "cp": 3}),
        (1, {}, {"dp_shard": 1}),
    ],
)
def test_sizes_inferred_and_ordered(world, kwargs, expected):
    dims = mesh_dims(world, **kwargs)
    assert dims == expected
    assert list(dims) == [n for n in ("dp_replicate", "dp_shard", "cp", "tp") if n in dims]  # TP innermost
    assert math.prod(dims.values()) == world


def test_size_one_dims_are_left_out_but_dp_shard_stays():
    assert mesh_dims(2, dp_replicate=2) == {"dp_replicate": 2, "dp_shard": 1}
    assert mesh_dims(2, dp_replicate=1, dp_shard=1, cp=1, tp=2) == {"dp_shard": 1, "tp": 2}


def test_product_mismatch_spells_out_the_arithmetic():
    with pytest.raises(ValueError, match=r"dp_replicate 2 x dp_shard 3 x cp 1 x tp 2 = 12, but the world has 8 ranks"):
        mesh_dims(8, dp_replicate=2, dp_shard=3, tp=2)


def test_inference_that_cannot_divide():
    with pytest.raises(ValueError, match=r"dp_shard -1 x cp 1 x tp 3: the given sizes multiply to 3, which does not divide the world of 8"):
        mesh_dims(8, tp=3)


def test_only_one_inferred_size():
    with pytest.raises(ValueError, match="only one mesh size may be -1.*give it a size"):
        mesh_dims(8, tp=-1)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match=f"tp must be a positive int or -1 \\(inferred\\), got {bad!r}"):
        mesh_dims(8, tp=bad)


def test_flattened_views():
    assert flattened_dims({"dp_shard": 8}) == {}
    assert flattened_dims({"dp_shard": 4, "tp": 2}) == {}
    assert flattened_dims({"dp_replicate": 2, "dp_shard": 2, "tp": 2}) == {"dp": ("dp_replicate", "dp_shard")}
    assert flattened_dims({"dp_shard": 2, "cp": 2, "tp": 2}) == {
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_shard", "cp"),
    }
    assert flattened_dims({"dp_replicate": 2, "dp_shard": 2, "cp": 2}) == {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    }
