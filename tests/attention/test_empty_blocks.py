"""Token grids with fewer tokens than blocks on some axis: the extra blocks are empty.

The rule ``floor(c * L / G)`` still assigns every token to a block; blocks that receive no token
have zero key-value summary and key sum and hold no query. The fast operator must still equal its
O(N^2) reference there, with finite gradients (no ``0 / 0`` from an empty block anywhere).
"""

from __future__ import annotations

import pytest
import torch

import mhla_diffusion.models.processors.grid as grid_module
import mhla_diffusion.ops.attention as attention_module
from helpers.attention import make_inputs
from helpers.models import dit_inputs, run, wan_inputs
from mhla_diffusion import (
    MHLAConfig,
    block_plan,
    convert_to_mhla,
    mhla_attention,
    mhla_attention_reference,
    num_blocks,
    token_block_ids,
)

CASES = [
    # grid, layout: at least one axis with fewer tokens than blocks
    ((1, 4, 6), (3, 2, 2)),  # an image (1 frame) under a video layout
    ((1, 1), (2, 2)),  # a single token, three empty blocks
    ((2, 3), (4, 1)),  # empty blocks between real ones: tokens go to blocks 0 and 2 of 4
    ((3,), (5,)),
    ((2, 5, 3), (3, 2, 4)),  # short on two axes, uneven on another
]


def _mixing(m, per_head, normalize, seed=1):
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn((3, m, m) if per_head else (m, m), generator=g, dtype=torch.float64)
    if normalize != "none":  # keep the denominator away from zero: positive weights as after init
        mixing = mixing.abs() + 0.1
    return mixing


def test_tokens_follow_the_floor_rule_and_empty_blocks_are_all_padding():
    assert token_block_ids((2, 3), (4, 1)).tolist() == [0, 0, 0, 2, 2, 2]
    assert token_block_ids((1, 1), (2, 2)).tolist() == [0]
    plan = block_plan((2, 3), (4, 1))
    assert plan.valid.tolist() == [[True] * 3, [False] * 3, [True] * 3, [False] * 3]
    plan = block_plan((1, 4, 6), (3, 2, 2))
    assert plan.num_blocks == 12 and plan.valid[:4].all() and not plan.valid[4:].any()
    assert plan.gather.min() >= 0 and plan.gather.max() < 24  # padding points at real tokens
    torch.testing.assert_close(plan.gather[plan.scatter], torch.arange(24))  # scatter undoes gather


@pytest.mark.parametrize("grid,layout", CASES)
@pytest.mark.parametrize("normalize", ["denominator", "none"])
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_matches_reference(grid, layout, normalize, rotated, per_head):
    q, k, v, q_rot, k_rot = make_inputs(grid, batch=2, seed=len(grid) + sum(layout))
    mixing = _mixing(num_blocks(layout), per_head, normalize)
    rot = dict(q_rot=q_rot, k_rot=k_rot) if rotated else {}
    fast = mhla_attention(q, k, v, grid, layout, mixing, normalize=normalize, **rot)
    slow = mhla_attention_reference(q, k, v, grid, layout, mixing, normalize=normalize, **rot)
    assert fast.shape == v.shape and torch.isfinite(fast).all()
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    chunked = mhla_attention(q, k, v, grid, layout, mixing, normalize=normalize, heads_per_chunk=2, **rot)
    torch.testing.assert_close(chunked, slow, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("grid,layout", CASES)
@pytest.mark.parametrize("normalize", ["denominator", "none"])
def test_gradients_match_reference_and_are_finite(grid, layout, normalize):
    inputs = make_inputs(grid, batch=2, seed=3)
    mixing = _mixing(num_blocks(layout), True, normalize)

    def grads(operator):
        leaves = [t.clone().requires_grad_(True) for t in (*inputs, mixing)]
        q, k, v, q_rot, k_rot, w = leaves
        out = operator(q, k, v, grid, layout, w, q_rot=q_rot, k_rot=k_rot, normalize=normalize)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        return [t.grad for t in leaves]

    fast, slow = grads(mhla_attention), grads(mhla_attention_reference)
    for name, f, s in zip(("q", "k", "v", "q_rot", "k_rot", "mixing"), fast, slow):
        if s is None:  # without a denominator the un-rotated q, k are unused
            assert f is None and normalize == "none" and name in ("q", "k"), name
            continue
        assert torch.isfinite(f).all(), name
        torch.testing.assert_close(f, s, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("grid,layout", CASES)
def test_no_zero_over_zero_even_without_eps(grid, layout):
    """Identity mixing, ``eps=0``: an empty block's slots would be ``0 / 0``; real tokens divide by
    their own block's key sum only. Forward and gradients stay finite and equal the reference."""
    inputs = [t.clone().requires_grad_(True) for t in make_inputs(grid, batch=2, seed=5)[:3]]
    mixing = torch.eye(num_blocks(layout), dtype=torch.float64, requires_grad=True)
    out = mhla_attention(*inputs, grid, layout, mixing, normalize="denominator", eps=0.0)
    out.square().sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(t.grad).all() for t in (*inputs, mixing))
    reference = mhla_attention_reference(*inputs, grid, layout, mixing, normalize="denominator", eps=0.0)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)


def test_empty_blocks_add_nothing():
    """Mixing weights towards an empty block change nothing: its summaries are zero."""
    grid, layout = (2, 3), (4, 1)  # blocks 1 and 3 are empty
    q, k, v, _, _ = make_inputs(grid, seed=7)
    mixing = _mixing(4, False, "denominator")
    changed = mixing.clone()
    changed[:, [1, 3]] += 5.0  # columns: what every block takes from the empty ones
    changed[[1, 3], :] = -3.0  # rows: the empty blocks' own (absent) queries
    for normalize in ("denominator", "none"):
        torch.testing.assert_close(
            mhla_attention(q, k, v, grid, layout, changed, normalize=normalize),
            mhla_attention(q, k, v, grid, layout, mixing, normalize=normalize),
        )


@pytest.mark.parametrize("grid,layout", [((1, 4, 6), (3, 2, 2)), ((1, 1), (2, 2)), ((2, 3), (4, 1))])
def test_scalar_mixed_denominator_still_refuses_uneven_or_empty_blocks(grid, layout):
    q, k, v, _, _ = make_inputs(grid)
    mixing = _mixing(num_blocks(layout), False, "denominator")
    for operator in (mhla_attention, mhla_attention_reference):
        with pytest.raises(
            ValueError,
            match=r"'scalar_mixed_denominator' .* needs equal-size blocks, but the block "
            r"layout .* does not divide the token grid",
        ):
            operator(q, k, v, grid, layout, mixing, normalize="scalar_mixed_denominator")


def test_layout_still_needs_a_block_per_axis():
    q, k, v, _, _ = make_inputs((2, 3))
    with pytest.raises(ValueError, match=r"`layout` \(0, 1\) has fewer than 1 block on axis \[0\]"):
        mhla_attention(q, k, v, (2, 3), (0, 1), torch.ones(0, 0, dtype=torch.float64))
    with pytest.raises(ValueError, match="has 3 axes but `grid`"):
        mhla_attention(q, k, v, (2, 3), (1, 1, 1), torch.ones(1, 1, dtype=torch.float64))


def test_tiny_wan_runs_a_one_frame_grid_under_a_larger_layout(tiny_wan, monkeypatch):
    """An image (1 latent frame) through a Wan model whose layout has 2 frame blocks: one plan per forward."""
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2)))
    built = []
    original = attention_module.block_plan
    monkeypatch.setattr(attention_module, "block_plan", lambda *a, **kw: built.append(a) or original(*a, **kw))
    grid_built = []
    grid_original = grid_module.block_plan
    monkeypatch.setattr(grid_module, "block_plan", lambda *a, **kw: grid_built.append(a) or grid_original(*a, **kw))
    out = run(tiny_wan, wan_inputs(frames=1, batch=2))
    assert out.shape == (2, 16, 1, 16, 20) and torch.isfinite(out).all()
    assert grid_built == [((1, 8, 10), (2, 2, 2))] and not built  # built once, reused by every layer
    # the same with gradients (training on image buckets)
    tiny_wan.train()
    tiny_wan.zero_grad()
    tiny_wan(**wan_inputs(frames=1, height=1, width=1)).sample.square().mean().backward()  # grid (1, 1, 1)
    grads = [p.grad for p in tiny_wan.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_explicit_layout_larger_than_the_target_grid_converts(tiny_wan):
    conversion_config = MHLAConfig(layout=(3, 6, 10), target_grid=(1, 4, 4))
    convert_to_mhla(tiny_wan, conversion_config)
    out = run(tiny_wan, wan_inputs(frames=1, height=4, width=4))
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="needs equal-size blocks"):
        MHLAConfig(layout=(3, 6, 10), target_grid=(1, 4, 4), normalization="scalar_mixed_denominator")


def test_tiny_dit_with_lepe_runs_a_layout_larger_than_its_grid(tiny_dit):
    """DiT's 4x4 token grid cut 5x3 (one of the 5 row blocks is empty), with LePE and per-head mixing."""
    convert_to_mhla(tiny_dit, MHLAConfig(layout=(5, 3), lepe=True, per_head_mixing=True))
    tiny_dit.zero_grad()
    tiny_dit(**dit_inputs()).sample.square().mean().backward()
    grads = [p.grad for p in tiny_dit.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
