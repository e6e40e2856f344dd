"""The operator's own feature map and RoPE (``feature_eps`` / ``rotary``, the processors' path) against the
O(N^2) reference on ``φ(q)``, ``φ(k)`` and their rotations, with and without autograd."""

from __future__ import annotations

import pytest
import torch

from helpers.attention import make_inputs
from mhla_diffusion import mhla_attention, mhla_attention_reference, num_blocks
from mhla_diffusion.benchmarks.attention_traffic import rotary_tables
from mhla_diffusion.models.processors.base import apply_interleaved_rotary

EPS = 1e-3  # large enough that a misplaced feature-map shift shows

CASES = [
    ((4, 4, 6), (2, 2, 3)),  # even blocks
    ((5, 6, 7), (2, 2, 3)),  # uneven blocks
    ((1, 4, 6), (2, 2, 3)),  # empty blocks (fewer frames than frame blocks)
]


def _rotary(n: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random RoPE tables of Wan's layout (:func:`mhla_diffusion.benchmarks.attention_traffic.rotary_tables`) in
    ``dtype``."""
    return tuple(t.to(dtype) for t in rotary_tables(n, dim, generator=torch.Generator().manual_seed(7)))


def _expected(q, k, v, grid, layout, mixing, rotary, normalize):
    phi_q, phi_k = torch.relu(q) + EPS, torch.relu(k) + EPS
    rot = (
        {}
        if rotary is None
        else dict(q_rot=apply_interleaved_rotary(phi_q, *rotary), k_rot=apply_interleaved_rotary(phi_k, *rotary))
    )
    return mhla_attention_reference(phi_q, phi_k, v, grid, layout, mixing, normalize=normalize, eps=1e-6, **rot)


# the released DiT denominator needs equal blocks: the even grid only
NORMALIZED = [(grid, layout, normalize) for grid, layout in CASES for normalize in ("denominator", "none")]
NORMALIZED.append((*CASES[0], "scalar_mixed_denominator"))


@pytest.mark.parametrize("grid,layout,normalize", NORMALIZED)
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("grad", [False, True])
def test_matches_reference_on_mapped_features(grid, layout, normalize, rope, grad):
    _, _, v, q, k = make_inputs(grid, heads=2, dim=6, value_dim=5, seed=sum(grid))  # q, k of both signs
    m = num_blocks(layout)
    mixing = torch.rand(2, m, m, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.1
    rotary = _rotary(q.shape[1], q.shape[3], torch.float64) if rope else None
    want = _expected(q, k, v, grid, layout, mixing, rotary, normalize)
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v, mixing)]
    got = mhla_attention(
        *leaves[:3], grid, layout, leaves[3], normalize=normalize, eps=1e-6, feature_eps=EPS, rotary=rotary
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if grad:
        got.square().sum().backward()
        ref = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
        _expected(*ref[:3], grid, layout, ref[3], rotary, normalize).square().sum().backward()
        for mine, theirs in zip(leaves, ref):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-9)


def test_non_contiguous_projections_are_read_in_place():
    grid, layout = (4, 4, 6), (2, 2, 3)
    _, _, v, q, k = make_inputs(grid, heads=2, dim=6, value_dim=6, seed=1)
    fused = torch.cat((q, k, v), dim=-1)  # (B, N, H, 3D): q, k, v as strided slices
    qs, ks, vs = fused[..., :6], fused[..., 6:12], fused[..., 12:]
    rotary = _rotary(q.shape[1], 6, torch.float64)
    mixing = torch.rand(num_blocks(layout), num_blocks(layout), dtype=torch.float64) + 0.1
    got = mhla_attention(qs, ks, vs, grid, layout, mixing, feature_eps=EPS, rotary=rotary)
    torch.testing.assert_close(got, mhla_attention(q, k, v, grid, layout, mixing, feature_eps=EPS, rotary=rotary))
    torch.testing.assert_close(got, _expected(q, k, v, grid, layout, mixing, rotary, "denominator"))


def test_bf16_projections_stay_close_to_the_reference():
    grid, layout = (5, 6, 7), (2, 2, 3)
    _, _, v, q, k = make_inputs(grid, heads=2, dim=16, value_dim=16, dtype=torch.float32, seed=2)
    rotary = _rotary(q.shape[1], 16, torch.float32)
    mixing = torch.rand(num_blocks(layout), num_blocks(layout)) + 0.1
    want = _expected(
        *(t.double() for t in (q, k, v)),
        grid,
        layout,
        mixing.double(),
        tuple(t.double() for t in rotary),
        "denominator",
    )
    got = mhla_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), grid, layout, mixing, feature_eps=EPS, rotary=rotary)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-2


def test_mixed_up_arguments_are_refused():
    grid, layout = (2, 2, 2), (1, 1, 2)
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=1, dim=4, value_dim=4)
    mixing = torch.eye(2, dtype=torch.float64)
    rotary = _rotary(8, 4, torch.float64)
    with pytest.raises(ValueError, match="pass `feature_eps` with it"):
        mhla_attention(q, k, v, grid, layout, mixing, rotary=rotary)
    with pytest.raises(ValueError, match="pass `rotary=\\(cos, sin\\)` instead"):
        mhla_attention(q, k, v, grid, layout, mixing, feature_eps=EPS, q_rot=q_rot, k_rot=k_rot)
    with pytest.raises(ValueError, match=r"`rotary` cos must have shape \(1, 8, 1, 4\)"):
        mhla_attention(q, k, v, grid, layout, mixing, feature_eps=EPS, rotary=(rotary[0][:, :4], rotary[1]))
