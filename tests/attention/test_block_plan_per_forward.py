"""The block plan is built once per transformer forward (per layout and device) and reused by every
MHLA layer of that forward; a precomputed plan leaves the operator's result unchanged."""

from __future__ import annotations

import copy
import math
import pickle

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
    mixing_init,
)
from mhla_diffusion.models.processors.grid import TokenGridContext

CASES = [
    ((7,), (3,)),
    ((5, 6), (2, 4)),
    ((7, 3), (3, 3)),
    ((3, 5, 7), (2, 2, 3)),
    ((2, 4, 6), (2, 2, 3)),
    ((5, 4, 3), (3, 1, 2)),
]


@pytest.fixture
def plan_builds(monkeypatch):
    """Every ``block_plan`` call made by the grid context or the operator, as ``(grid, layout, device)``."""
    builds = []
    real = block_plan

    def counting(grid, layout, device=None):
        plan = real(grid, layout, device=device)
        builds.append((plan.grid, plan.layout, plan.device))
        return plan

    monkeypatch.setattr(grid_module, "block_plan", counting)
    monkeypatch.setattr(attention_module, "block_plan", counting)
    return builds


# ------------------------------------------------------------------ (a) one build per forward


def test_one_plan_per_wan_forward(tiny_wan, plan_builds):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2)))  # all 3 layers MHLA
    run(tiny_wan, wan_inputs())
    assert plan_builds == [((3, 8, 10), (2, 2, 2), torch.device("cpu"))]
    run(tiny_wan, wan_inputs(seed=1))
    assert len(plan_builds) == 2  # one more for the next forward, not one per layer


def test_one_plan_per_dit_forward_with_batch(tiny_dit, plan_builds):
    convert_to_mhla(tiny_dit, MHLAConfig())  # auto 2x2 layout on the 4x4 grid, both layers
    for step in range(3):
        run(tiny_dit, dit_inputs(batch=2, seed=step))  # a guidance-style doubled batch is still one forward
    assert plan_builds == [((4, 4), (2, 2), torch.device("cpu"))] * 3


def test_one_plan_per_forward_in_training(tiny_wan, plan_builds):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2)))
    tiny_wan.train()
    tiny_wan(**wan_inputs()).sample.square().mean().backward()
    assert len(plan_builds) == 1
    assert tiny_wan.blocks[2].attn1.processor.mixing.grad is not None


def test_one_plan_per_layout_and_device():
    context = TokenGridContext()
    context.set_grid((3, 5, 7))
    first = context.plan((2, 2, 3), "cpu")
    assert context.plan([2, 2, 3], torch.device("cpu")) is first
    other = context.plan((1, 2, 2), "cpu")
    assert other is not first and other.layout == (1, 2, 2)
    assert context.plan((1, 2, 2), "cpu") is other


# ------------------------------------------------------------------ (b) results unchanged


@pytest.mark.parametrize("grid,layout", CASES)
@pytest.mark.parametrize("per_head", [False, True])
def test_precomputed_plan_gives_identical_output(grid, layout, per_head):
    q, k, v, q_rot, k_rot = make_inputs(grid, seed=sum(grid))
    m = math.prod(layout)
    mixing = (
        torch.rand((3, m, m) if per_head else (m, m), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        + 0.1
    )
    plan = block_plan(grid, layout, device=q.device)
    for rot in ({}, dict(q_rot=q_rot, k_rot=k_rot)):
        for normalize in (True, False):
            for chunk in (None, 2):
                kwargs = dict(normalize=normalize, heads_per_chunk=chunk, **rot)
                fresh = mhla_attention(q, k, v, grid, layout, mixing, **kwargs)
                reused = mhla_attention(q, k, v, grid, layout, mixing, plan=plan, **kwargs)
                assert torch.equal(reused, fresh)
                slow = mhla_attention_reference(q, k, v, grid, layout, mixing, normalize=normalize, **rot)
                torch.testing.assert_close(reused, slow, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("grid", [(3, 8, 10), (5, 3, 4)])  # the second is uneven under the 2x3x3 layout
def test_model_output_identical_to_building_the_plan_in_every_call(tiny_wan, monkeypatch, grid):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 3, 3), gate=True, output_norm=True))
    inputs = wan_inputs(*grid)
    cached = run(tiny_wan, inputs)
    # the operator builds its own
    monkeypatch.setattr(TokenGridContext, "plan", lambda self, layout, device, grid=None: None)
    assert torch.equal(run(tiny_wan, inputs), cached)


# ------------------------------------------------------------------ (c) no stale plan


def test_new_grid_on_next_forward_gets_a_new_plan(tiny_wan, plan_builds):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 3, 3)))
    context = tiny_wan.blocks[0].attn1.processor.grid_context
    grids = [(3, 8, 10), (5, 3, 4), (3, 8, 10), (2, 7, 9)]
    for grid in grids:
        out = run(tiny_wan, wan_inputs(*grid))
        assert out.shape == (1, 16, grid[0], 2 * grid[1], 2 * grid[2]) and torch.isfinite(out).all()
        assert [plan.grid for plan in context._plans.values()] == [grid]  # only this forward's plan is kept
    assert [build[0] for build in plan_builds] == grids


def test_grid_set_directly_never_meets_a_stale_plan():
    context = TokenGridContext()
    context.grid = (4, 4)  # as a caller without the hook may do
    first = context.plan((2, 2), "cpu")
    context.grid = (6, 4)
    second = context.plan((2, 2), "cpu")
    assert (first.grid, second.grid) == ((4, 4), (6, 4))


def test_inference_mode_plan_is_not_reused_for_autograd():
    context = TokenGridContext()
    context.set_grid((3, 4))
    with torch.inference_mode():
        inference = context.plan((2, 2), "cpu")
    plan = context.plan((2, 2), "cpu")
    assert plan is not inference and not plan.gather.is_inference()


def test_grid_smaller_than_layout_gets_one_plan_with_empty_blocks(tiny_wan):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(3, 2, 2)))
    out = run(tiny_wan, wan_inputs(frames=1))  # token grid (1, 8, 10): frame blocks 1 and 2 are empty
    assert torch.isfinite(out).all()
    context = tiny_wan.blocks[0].attn1.processor.grid_context
    (plan,) = context._plans.values()
    assert plan.grid == (1, 8, 10) and not plan.valid[4:].any() and plan.valid[:4].any()


def test_layout_with_other_axes_is_a_clear_error_before_attention(tiny_wan, monkeypatch):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(3, 2, 2)))
    calls = []
    monkeypatch.setattr(attention_module, "_mhla_blocks", lambda *args: calls.append(args))
    for processor in {id(b.attn1.processor): b.attn1.processor for b in tiny_wan.blocks}.values():
        processor.layout = (2, 2)
    with pytest.raises(ValueError, match=r"layout \(2, 2\) does not fit this forward's token grid \(1, 8, 10\)"):
        run(tiny_wan, wan_inputs(frames=1))
    assert not calls


def test_deepcopy_and_pickle_keep_separate_plans(tiny_wan):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2)))
    run(tiny_wan, wan_inputs())
    original = tiny_wan.blocks[0].attn1.processor.grid_context
    twin = copy.deepcopy(tiny_wan)
    copied = twin.blocks[0].attn1.processor.grid_context
    assert copied is not original and twin.blocks[2].attn1.processor.grid_context is copied
    assert copied.grid == (3, 8, 10) and not copied._plans and len(original._plans) == 1
    run(twin, wan_inputs(3, 4, 6))
    assert [p.grid for p in copied._plans.values()] == [(3, 4, 6)]
    assert [p.grid for p in original._plans.values()] == [(3, 8, 10)]
    assert not pickle.loads(pickle.dumps(original))._plans


# ------------------------------------------------------------------ (d) a wrong plan is refused


def test_mismatched_plan_is_a_clear_error():
    grid, layout = (3, 4), (2, 2)
    q, k, v, _, _ = make_inputs(grid)
    mixing = mixing_init(layout, dtype=torch.float64)
    cases = [
        (block_plan((4, 3), layout), r"built for grid \(4, 3\) and layout \(2, 2\).*grid \(3, 4\)"),
        (block_plan(grid, (1, 2)), r"built for grid \(3, 4\) and layout \(1, 2\).*layout \(2, 2\)"),
        (block_plan(grid, layout, device="meta"), "on meta but the inputs are on cpu"),
        ("plan", "must be a BlockPlan"),
    ]
    for plan, message in cases:
        with pytest.raises(ValueError, match=message):
            mhla_attention(q, k, v, grid, layout, mixing, plan=plan)
    with pytest.raises(ValueError, match="N=13"):  # the plan fits grid and layout, not the inputs
        q13, k13, v13, _, _ = make_inputs((13,))
        mhla_attention(q13, k13, v13, grid, layout, mixing, plan=block_plan(grid, layout))
    with pytest.raises(ValueError, match="`grid`"):
        mhla_attention(q, k, v, 12, layout, mixing, plan=block_plan(grid, layout))


# ------------------------------------------------------------------ torch.compile


def test_compiles_with_plan_and_context_without_graph_breaks():
    grid, layout = (3, 4, 6), (1, 2, 3)
    q, k, v, q_rot, k_rot = make_inputs(grid, dtype=torch.float32)
    mixing = mixing_init(layout)
    context = TokenGridContext()
    context.set_grid(grid)

    def fn(q, k, v, q_rot, k_rot, mixing):
        plan = context.plan(layout, q.device)
        return mhla_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, heads_per_chunk=2, plan=plan)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(q, k, v, q_rot, k_rot, mixing)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, q_rot, k_rot, mixing), fn(q, k, v, q_rot, k_rot, mixing))
    assert len(context._plans) == 1  # the eager call cached one; the compiled graph built its own
