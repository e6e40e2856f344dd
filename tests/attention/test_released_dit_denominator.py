"""The released DiT-MHLA denominator (``normalize="scalar_mixed_denominator"``) in the operator.

``den(o, w) = Σ_j W[o, j] (q_(j,w) · z_j) + eps`` for the token at within-block position ``w`` of
block ``o`` (reference facts, section 2.2 step 7 and section 5 item 3).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.attention import check_operator_gradients, make_inputs
from mhla_diffusion import auto_layout, block_plan, mhla_attention, mhla_attention_reference, mixing_init, num_blocks
from mhla_diffusion.utils.geometry import check_equal_blocks

SCALAR = "scalar_mixed_denominator"

EVEN_CASES = [
    # grid, layout: every layout divides its grid (1-D, 2-D, 3-D; square and oblong blocks)
    ((12,), (4,)),
    ((6,), (1,)),  # one block: global linear attention
    ((4, 4), (2, 2)),
    ((8, 8), (2, 2)),  # 4x4-token blocks, as released (block_size 16)
    ((8, 8), (4, 4)),
    ((6, 8), (3, 2)),
    ((4, 6, 8), (2, 3, 2)),
    ((3, 4, 5), (3, 4, 5)),  # every token its own block
]


def positive_mixing(m, per_head, heads=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (heads, m, m) if per_head else (m, m)
    return torch.rand(shape, generator=g, dtype=torch.float64) + 0.05  # non-negative, as after the [0, 1] clamp


@pytest.mark.parametrize("grid,layout", EVEN_CASES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rotated", [False, True])
def test_fast_operator_matches_reference(grid, layout, per_head, rotated):
    q, k, v, q_rot, k_rot = make_inputs(grid, batch=2, seed=len(grid) + sum(layout))
    mixing = positive_mixing(num_blocks(layout), per_head)
    rot = dict(q_rot=q_rot, k_rot=k_rot) if rotated else {}
    fast = mhla_attention(q, k, v, grid, layout, mixing, normalize=SCALAR, **rot)
    slow = mhla_attention_reference(q, k, v, grid, layout, mixing, normalize=SCALAR, **rot)
    assert fast.shape == v.shape and fast.dtype == v.dtype
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    # the plan, head chunks and a reused plan do not change the result
    plan = block_plan(grid, layout)
    chunked = mhla_attention(q, k, v, grid, layout, mixing, normalize=SCALAR, heads_per_chunk=2, plan=plan, **rot)
    torch.testing.assert_close(chunked, fast, rtol=1e-12, atol=1e-12)


def test_released_formula_on_the_block_major_sequence():
    """The facts' formula verbatim on a 1-D grid (the sequence is block-major already): view it as
    ``[M, L]`` per head, ``S_j = K_jᵀ V_j``, ``S̃ = W S``, numerator ``qᵀ S̃_o``, denominator
    ``Σ_j W[o, j] q_(j,w)ᵀ z_j + eps``."""
    m, length, heads, d, dv, batch, eps = 4, 5, 2, 3, 4, 2, 1e-6
    q, k, v, _, _ = make_inputs((m * length,), heads=heads, dim=d, value_dim=dv, batch=batch, seed=7)
    w = positive_mixing(m, per_head=False)
    qb, kb, vb = (x.view(batch, m, length, heads, -1) for x in (q, k, v))  # [B, M, L, H, D]
    expected = torch.empty_like(v).view(batch, m, length, heads, dv)
    for b in range(batch):
        for h in range(heads):
            kv = [kb[b, j, :, h].T @ vb[b, j, :, h] for j in range(m)]  # S_j: D x Dv
            z = [kb[b, j, :, h].sum(0) for j in range(m)]  # z_j: D
            for o in range(m):
                mixed = sum(w[o, j] * kv[j] for j in range(m))
                for pos in range(length):
                    den = sum(w[o, j] * (qb[b, j, pos, h] @ z[j]) for j in range(m)) + eps
                    expected[b, o, pos, h] = qb[b, o, pos, h] @ mixed / den
    out = mhla_attention(q, k, v, (m * length,), (m,), w, normalize=SCALAR, eps=eps)
    torch.testing.assert_close(out, expected.view_as(v), rtol=1e-12, atol=1e-12)
    ref = mhla_attention_reference(q, k, v, (m * length,), (m,), w, normalize=SCALAR, eps=eps)
    torch.testing.assert_close(ref, expected.view_as(v), rtol=1e-12, atol=1e-12)


def test_within_block_position_is_row_major_inside_the_block():
    """On a 2-D grid, token (r, c) is paired with the token at the same (r mod p_r, c mod p_c) in the
    other blocks: checked on a one-hot example against a hand-written expectation."""
    grid, layout = (4, 4), (2, 2)
    n = 16
    q = torch.full((1, n, 1, 1), 1e-3, dtype=torch.float64)
    q[0, 3 * 4 + 2] = 1.0  # token (3, 2): block 3 (bottom right), position (1, 0) -> w = 2
    k = torch.ones(1, n, 1, 1, dtype=torch.float64)
    v = torch.ones(1, n, 1, 1, dtype=torch.float64)
    mixing = torch.zeros(4, 4, dtype=torch.float64)
    mixing[0, 3] = 1.0  # block 0 reads only block 3
    out = mhla_attention(q, k, v, grid, layout, mixing, normalize=SCALAR, eps=0.0)
    # token (1, 0) sits at position w = 2 of block 0: numerator q_(1,0) · Σ_{s in block 3} k_s v_s = 1e-3 * 4,
    # denominator W[0, 3] q_(3, w=2) · z_3 = 1.0 * 4
    assert out[0, 1 * 4 + 0, 0, 0].item() == pytest.approx(1e-3)
    # and token (0, 0) (w = 0) divides by q_(3, w=0) = token (2, 2) = 1e-3: numerator 4e-3 / 4e-3
    assert out[0, 0, 0, 0].item() == pytest.approx(1.0)


def test_equals_the_paper_denominator_when_mixing_is_diagonal():
    grid, layout = (4, 6), (2, 3)
    q, k, v, q_rot, k_rot = make_inputs(grid)
    mixing = torch.diag(torch.rand(6, dtype=torch.float64) + 0.5)
    released = mhla_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, normalize=SCALAR)
    paper = mhla_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, normalize=True)
    torch.testing.assert_close(released, paper, rtol=1e-12, atol=1e-12)
    # with the real (non-diagonal) init they differ
    init = mixing_init(layout, dtype=torch.float64)
    differs = mhla_attention(q, k, v, grid, layout, init, normalize=SCALAR) - mhla_attention(
        q, k, v, grid, layout, init
    )
    assert differs.abs().max() > 1e-3


def test_normalize_accepts_names_and_booleans():
    grid, layout = (4, 4), (2, 2)
    q, k, v, _, _ = make_inputs(grid)
    mixing = positive_mixing(4, False)
    for flag, name in ((True, "denominator"), (False, "none")):
        torch.testing.assert_close(
            mhla_attention(q, k, v, grid, layout, mixing, normalize=flag),
            mhla_attention(q, k, v, grid, layout, mixing, normalize=name),
            rtol=0,
            atol=0,
        )
    with pytest.raises(ValueError, match="`normalize` must be True"):
        mhla_attention(q, k, v, grid, layout, mixing, normalize="scalar")


@pytest.mark.parametrize("fn", [mhla_attention, mhla_attention_reference])
def test_uneven_blocks_are_refused_with_grid_layout_and_fix(fn):
    grid, layout = (5, 6), (2, 4)
    q, k, v, _, _ = make_inputs(grid)
    with pytest.raises(ValueError) as error:
        fn(q, k, v, grid, layout, positive_mixing(8, False), normalize=SCALAR)
    message = str(error.value)
    assert "(5, 6)" in message and "(2, 4)" in message and "scalar_mixed_denominator" in message
    assert "e.g. (1, 3)" in message  # a layout that divides the grid is suggested
    # the same inputs are fine with the paper's denominator (uneven blocks allowed there)
    fn(q, k, v, grid, layout, positive_mixing(8, False), normalize=True)


def test_check_equal_blocks_suggests_dividing_layouts():
    check_equal_blocks((16, 16), (4, 4))
    check_equal_blocks((21, 30, 50), (3, 5, 10))
    with pytest.raises(
        ValueError, match=r"does not divide the token grid \(16, 16\).*e\.g\. \(2, 2\).*e\.g\. \(18, 18\)"
    ):
        check_equal_blocks((16, 16), (3, 3))


def test_gradcheck_float64():
    check_operator_gradients((4, 4), (2, 2), normalize=SCALAR)


def test_no_token_pair_matrix_is_formed():
    """O(N): at N = 4096 tokens an N x N float64 matrix (128 MiB) would dominate; the operator's
    largest intermediate stays a small multiple of the inputs."""
    grid, layout = (64, 64), (8, 8)
    n = math.prod(grid)
    q, k, v, _, _ = make_inputs(grid, heads=1, dim=2, value_dim=2, batch=1)
    sizes = []

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    with Largest():
        mhla_attention(q, k, v, grid, layout, mixing_init(layout, dtype=torch.float64), normalize=SCALAR)
    assert max(sizes) < n * 16


def test_auto_layout_with_equal_blocks_divides_the_grid():
    assert auto_layout((16, 16), equal_blocks=True) == (4, 4) == auto_layout((16, 16))  # DiT-XL/2 at 256 px
    for grid in [(4, 4), (8, 8), (32, 32), (14, 14), (16, 32), (21, 30, 52), (7, 7)]:
        layout = auto_layout(grid, equal_blocks=True)
        assert all(g % b == 0 for g, b in zip(grid, layout)), (grid, layout)
        assert num_blocks(layout) <= math.isqrt(math.prod(grid))
