"""Plain O(N^2) MHLA, the obviously-correct definition the fast operator is tested against.

It forms the full token-pair weight matrix ``W[b(t), b(s)]`` and the full score matrix, so use it
only on small inputs (tests, debugging).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .attention import validate_attention_inputs
from .block_layout import token_block_ids

__all__ = ["mhla_attention_reference"]


def mhla_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    *,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Same contract as :func:`mhla_attention`, computed token pair by token pair.

    ``out_t = Σ_s W[b(t), b(s)] (q̂_t · k̂_s) v_s``, divided by ``Σ_s W[b(t), b(s)] (q_t · k_s) + eps``
    when ``normalize``. Shapes: ``q, k`` ``(B, N, H, D)``, ``v`` ``(B, N, H, Dv)`` -> ``(B, N, H, Dv)``.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, mixing, q_rot, k_rot)
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    q_hat = (q if q_rot is None else q_rot).to(dtype)
    k_hat = (k if k_rot is None else k_rot).to(dtype)
    block = token_block_ids(grid, layout, device=q.device)
    pair_weight = mixing.to(dtype)[..., block[:, None], block[None, :]]  # (N, N) or (H, N, N)
    if pair_weight.ndim == 2:
        pair_weight = pair_weight.unsqueeze(0)

    scores = torch.einsum("bthd,bshd->bhts", q_hat, k_hat) * pair_weight
    out = torch.einsum("bhts,bshe->bthe", scores, v.to(dtype))
    if normalize:
        plain = torch.einsum("bthd,bshd->bhts", q.to(dtype), k.to(dtype)) * pair_weight
        out = out / (plain.sum(dim=-1) + eps).transpose(1, 2).unsqueeze(-1)
    return out.to(v.dtype)
