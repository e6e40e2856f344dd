"""Mixing initialisation (reference-code facts) and the block layout rules."""

from __future__ import annotations

import math

import pytest
import torch

from mhla_diffusion import MHLAConfig, auto_layout, block_plan, mixing_init, token_block_ids
from mhla_diffusion.ops.block_layout import estimated_cost_ratio


def test_linear_column_normalised_on_4x4():
    w = mixing_init((4, 4))
    torch.testing.assert_close(w.sum(dim=0), torch.ones(16))
    diag = w.diagonal()
    assert 0.099 <= diag.min() and diag.max() <= 0.145  # 0.10-0.14 in the reference
    assert int((w == 0).sum()) == 4  # the 4 corner-to-corner pairs sit at the global max distance
    rows = w.sum(dim=1)
    assert rows.min() < 0.9 and rows.max() > 1.1  # rows are not normalised in the reference scheme
    assert not torch.allclose(w, w.T)


def test_linear_on_video_layout():
    w = mixing_init((3, 5, 10))
    assert w.shape == (150, 150)
    diag = w.diagonal()
    assert 0.0095 <= diag.min() and diag.max() <= 0.015
    assert int((w == 0).sum()) == 8
    torch.testing.assert_close(w.sum(dim=0), torch.ones(150))


def test_block_enumeration_is_row_major():
    # blocks of a (2, 3) layout: 0..2 on row 0, 3..5 on row 1; distances from block 0 follow
    w = mixing_init((2, 3), "exp", exp_sigma=1.0, normalization="row", dtype=torch.float64)
    distances = torch.tensor([0, 1, 2, 1, math.sqrt(2), math.sqrt(5)], dtype=torch.float64)
    torch.testing.assert_close(w[0] / w[0, 0], torch.exp(-distances))


@pytest.mark.parametrize("transform", ["linear", "cos", "exp", "local"])
def test_column_transforms_sum_to_one(transform):
    w = mixing_init((3, 4), transform)
    torch.testing.assert_close(w.sum(dim=0), torch.ones(12))
    assert (w >= 0).all()


def test_cos_range_and_gaussian_unnormalised():
    a = torch.cos(torch.tensor(math.pi / 4))
    w = mixing_init((4, 4), "cos") * 1  # column-normalised cos: ratios within [cos(pi/4), 1]
    ratio = w / w.max(dim=0).values
    assert ratio.min() >= a - 1e-6
    g = mixing_init((4, 4), "gaussian")
    torch.testing.assert_close(g.diagonal(), torch.ones(16))
    assert 5 < g.sum(dim=0).min() and g.sum(dim=0).max() < 9.5


def test_local_neighbourhoods():
    w2 = mixing_init((5, 5), "local")
    assert int((w2 > 0).sum(dim=0).max()) == 9  # 3x3 neighbourhood
    w3 = mixing_init((3, 3, 3), "local")
    assert int((w3 > 0).sum(dim=0).max()) == 19  # self + 6 faces + 12 edges, no corners


@pytest.mark.parametrize("transform", ["linear", "cos", "exp", "gaussian", "local"])
def test_row_variant_rows_sum_to_one(transform):
    w = mixing_init((3, 4), transform, normalization="row")
    torch.testing.assert_close(w.sum(dim=1), torch.ones(12, dtype=w.dtype))
    if transform == "linear":  # each row's farthest block gets exactly 0
        assert ((w == 0).sum(dim=1) >= 1).all()


def test_single_block_and_bad_transform():
    assert mixing_init((1, 1, 1)).tolist() == [[1.0]]
    assert mixing_init((1,), "gaussian").tolist() == [[1.0]]
    with pytest.raises(ValueError, match="transform"):
        mixing_init((2, 2), "softmax")
    with pytest.raises(ValueError, match="transform"):
        MHLAConfig(transform="softmax")


def brute_force_ids(grid, layout):
    ids = []
    for coords in torch.cartesian_prod(*[torch.arange(g) for g in grid]).reshape(-1, len(grid)).tolist():
        block = 0
        for c, g, blocks in zip(coords, grid, layout):
            block = block * blocks + (c * blocks) // g
        ids.append(block)
    return torch.tensor(ids)


@pytest.mark.parametrize(
    "grid,layout", [((7,), (3,)), ((5, 6), (2, 4)), ((3, 5, 7), (2, 2, 3)), ((21, 30, 52), (3, 5, 10))]
)
def test_token_block_ids_and_plan(grid, layout):
    ids = token_block_ids(grid, layout)
    assert torch.equal(ids, brute_force_ids(grid, layout))
    plan = block_plan(grid, layout)
    # every token lands in exactly one valid slot of its own block, and scatter undoes gather
    n = math.prod(grid)
    assert torch.equal(plan.gather[plan.scatter], torch.arange(n))
    slot_block = torch.arange(plan.num_blocks * plan.block_len) // plan.block_len
    assert torch.equal(slot_block[plan.scatter], ids)
    valid = (
        torch.ones(plan.num_blocks * plan.block_len, dtype=torch.bool) if plan.valid is None else plan.valid.flatten()
    )
    assert int(valid.sum()) == n
    assert torch.equal(ids[plan.gather], slot_block)  # padded slots repeat a token of the same block


def test_auto_layout():
    assert auto_layout((21, 30, 50)) == (3, 5, 10)  # the reference's video layout
    assert auto_layout((16, 16)) == (4, 4)  # DiT-XL/2 at 256 px
    for grid in [(21, 30, 52), (9, 20, 26), (13, 17), (1, 30, 52), (5,)]:
        layout = auto_layout(grid)
        assert math.prod(layout) <= math.isqrt(math.prod(grid))
        assert all(1 <= b <= g for b, g in zip(layout, grid))
    assert math.prod(auto_layout((21, 30, 52), max_blocks=40)) <= 40
    # uneven blocks are padded: the choice keeps padding plus mixing near 1.35x linear attention
    assert estimated_cost_ratio((9, 20, 26), auto_layout((9, 20, 26))) <= 1.4
    assert estimated_cost_ratio((9, 20, 26), (3, 5, 13)) > 3  # the 195-block layout: mixing dominates
    assert estimated_cost_ratio((21, 30, 50), (3, 5, 10)) == pytest.approx(1 + 150**2 / 63000)
