"""Joint MHLA (image blocks and a text block) against its O((N + L)^2) reference, and what its special cases are."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.attention import make_inputs
from mhla_diffusion.models.processors.base import apply_interleaved_rotary
from mhla_diffusion.ops.block_layout import num_blocks
from mhla_diffusion.ops.joint import joint_mixing_init, mhla_joint_attention
from mhla_diffusion.ops.mixing import mixing_init
from mhla_diffusion.ops.naive import mhla_joint_attention_reference

CASES = [((4, 6), (2, 3)), ((5, 7), (2, 3)), ((3, 4, 5), (2, 2, 3)), ((2, 3, 4), (3, 1, 2))]


def _text(batch=2, length=5, heads=3, dim=4, value_dim=5, seed=7):
    g = torch.Generator().manual_seed(seed)
    text_q = torch.randn(batch, length, heads, dim, generator=g, dtype=torch.float64)
    text_k = torch.randn(batch, length, heads, dim, generator=g, dtype=torch.float64)
    text_v = torch.randn(batch, length, heads, value_dim, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, 3:] = False  # the first sample's prompt is 3 tokens, padded to 5
    mask[1, 1] = False  # and a hole, as a left-padded or packed mask has
    return text_q, text_k, text_v, mask


def _signed_mixing(m, per_head, normalize):
    g = torch.Generator().manual_seed(3)
    mixing = torch.randn((3, m, m) if per_head else (m, m), generator=g, dtype=torch.float64)
    return mixing.abs() + 0.1 if normalize else mixing


@pytest.mark.parametrize("grid,layout", CASES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_the_joint_operator_equals_its_reference(grid, layout, normalize, per_head, masked):
    """Raw projections through the operator's feature map and RoPE against features formed by hand."""
    q, k, v, _, _ = make_inputs(grid, seed=len(grid))
    q, k = q - 0.5, k - 0.5  # raw projections: signed
    text_q, text_k, text_v, mask = _text()
    mask = mask if masked else None
    mixing = _signed_mixing(num_blocks(layout) + 1, per_head, normalize)
    n, dim, eps = math.prod(grid), q.shape[-1], 1e-3
    angles = torch.rand(1, n, 1, dim // 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 6
    cos, sin = (f(angles).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))
    image, text = mhla_joint_attention(
        q, k, v, text_q, text_k, text_v, grid, layout, mixing,
        text_mask=mask, normalize=normalize, feature_eps=eps, rotary=(cos, sin),
    )  # fmt: skip
    phi = lambda x: x.relu() + eps  # noqa: E731
    want_image, want_text = mhla_joint_attention_reference(
        phi(q), phi(k), v, phi(text_q), phi(text_k), text_v, grid, layout, mixing, text_mask=mask,
        q_rot=apply_interleaved_rotary(phi(q), cos, sin), k_rot=apply_interleaved_rotary(phi(k), cos, sin),
        normalize=normalize,
    )  # fmt: skip
    torch.testing.assert_close(image, want_image, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(text, want_text, rtol=1e-10, atol=1e-10)


def test_features_in_equal_features_out_and_gradients():
    """Feature inputs (no ``feature_eps``) and ``q_rot`` / ``k_rot``, with gradients to every input and the mixing."""
    grid, layout = (3, 4), (2, 2)
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=2, dim=3, value_dim=2, batch=2)
    text_q, text_k, text_v, mask = _text(heads=2, dim=3, value_dim=2, length=4)
    text_q, text_k = text_q.abs(), text_k.abs()
    mixing = joint_mixing_init(mixing_init(layout, dtype=torch.float64)) + 0.05
    tensors = [t.clone().requires_grad_() for t in (q, k, v, text_q, text_k, text_v, q_rot, k_rot, mixing)]

    def fast(q, k, v, tq, tk, tv, qr, kr, w):
        return mhla_joint_attention(q, k, v, tq, tk, tv, grid, layout, w, text_mask=mask, q_rot=qr, k_rot=kr)

    def slow(q, k, v, tq, tk, tv, qr, kr, w):
        return mhla_joint_attention_reference(q, k, v, tq, tk, tv, grid, layout, w, text_mask=mask, q_rot=qr, k_rot=kr)

    for a, b in zip(fast(*tensors), slow(*tensors)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(fast, tensors, eps=1e-6, atol=1e-6)


def test_equal_mixing_is_global_linear_attention_over_the_valid_tokens():
    grid, layout = (4, 5), (2, 2)
    q, k, v, _, _ = make_inputs(grid)
    text_q, text_k, text_v, mask = _text()
    text_q, text_k = text_q.abs(), text_k.abs()
    m = num_blocks(layout) + 1
    image, text = mhla_joint_attention(q, k, v, text_q, text_k, text_v, grid, layout, torch.ones(m, m).double(),
                                       text_mask=mask)  # fmt: skip
    for b in range(2):
        keys = torch.cat([k[b], text_k[b][mask[b]]])  # (S, H, D)
        values = torch.cat([v[b], text_v[b][mask[b]]])
        queries = torch.cat([q[b], text_q[b]])
        num = torch.einsum("thd,shd,she->the", queries, keys, values)
        den = torch.einsum("thd,shd->th", queries, keys)[..., None] + 1e-6
        torch.testing.assert_close(torch.cat([image[b], text[b]]), num / den, rtol=1e-10, atol=1e-10)


def test_the_text_block_starts_as_near_as_each_blocks_own_summary():
    image = mixing_init((2, 3))
    joint = joint_mixing_init(image)
    m = image.shape[0]
    assert joint.shape == (m + 1, m + 1)
    torch.testing.assert_close(joint[:m, :m], image)
    torch.testing.assert_close(joint[:m, m], image.diagonal())
    torch.testing.assert_close(joint[m], torch.full((m + 1,), 1 / (m + 1)))
    per_head = joint_mixing_init(image.expand(4, m, m))
    assert per_head.shape == (4, m + 1, m + 1) and torch.equal(per_head[2], joint)


def test_bad_text_arguments_are_named():
    grid, layout = (2, 3), (1, 3)
    q, k, v, _, _ = make_inputs(grid)
    text_q, text_k, text_v, mask = _text()
    mixing = torch.ones(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"`text_v` must be \(B, L, H, D\)"):
        mhla_joint_attention(q, k, v, text_q, text_k, text_v[..., :2], grid, layout, mixing)
    with pytest.raises(ValueError, match="`text_mask` must be a bool tensor"):
        mhla_joint_attention(q, k, v, text_q, text_k, text_v, grid, layout, mixing, text_mask=mask.float())
    with pytest.raises(ValueError, match=r"joint `mixing` must be \(4, 4\)"):
        mhla_joint_attention(q, k, v, text_q, text_k, text_v, grid, layout, mixing[:3, :3])
    with pytest.raises(ValueError, match="no 'scalar_mixed_denominator'"):
        mhla_joint_attention(
            q, k, v, text_q, text_k, text_v, grid, layout, mixing, normalize="scalar_mixed_denominator"
        )
