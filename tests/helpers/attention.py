"""Random inputs for the attention operators, and the operator's float64 gradient check."""

from __future__ import annotations

import math

import torch


def make_inputs(grid, heads=3, dim=4, value_dim=5, batch=2, dtype=torch.float64, seed=0):
    """``(q, k, v, q_rot, k_rot)`` of shape ``(batch, prod(grid), heads, dim)`` (``value_dim`` for ``v``);
    ``q`` and ``k`` non-negative (feature-mapped), the rotated copies and ``v`` standard normal."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(grid)
    q = torch.rand(batch, n, heads, dim, generator=g, dtype=dtype)
    k = torch.rand(batch, n, heads, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, n, heads, value_dim, generator=g, dtype=dtype)
    q_rot = torch.randn(batch, n, heads, dim, generator=g, dtype=dtype)
    k_rot = torch.randn(batch, n, heads, dim, generator=g, dtype=dtype)
    return q, k, v, q_rot, k_rot


def check_operator_gradients(grid, layout, **options) -> list[torch.Tensor]:
    """Assert that ``torch.autograd.gradcheck`` passes for :func:`~mhla_diffusion.mhla_attention` on ``grid`` with
    ``layout`` and ``options`` (e.g. ``normalize``), in float64 with respect to ``q, k, v``, the rotated ``q, k``
    (2 heads of 3 channels, values of 2) and the mixing matrix (its init + 0.05). Returns those leaf tensors."""
    from mhla_diffusion import mhla_attention, mixing_init

    q, k, v, q_rot, k_rot = make_inputs(grid, heads=2, dim=3, value_dim=2, batch=1)
    mixing = mixing_init(layout, dtype=torch.float64) + 0.05
    tensors = [t.clone().requires_grad_() for t in (q, k, v, q_rot, k_rot, mixing)]

    def fn(q, k, v, q_rot, k_rot, mixing):
        return mhla_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, **options)

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-6)
    return tensors
