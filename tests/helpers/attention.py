"""Random inputs for the attention operators."""

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
