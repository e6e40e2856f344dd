"""Plain O(N^2) MHLA, the obviously-correct definitions the fast operators are tested against.

It forms the full token-pair weight matrix ``W[b(t), b(s)]`` and the full score matrix, so use it
only on small inputs (tests, debugging).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..utils.geometry import check_equal_blocks
from .attention import normalization_mode, validate_attention_inputs
from .block_layout import token_block_ids
from .causal import check_causal_arguments
from .joint import check_joint_arguments

__all__ = ["mhla_attention_reference", "mhla_causal_attention_reference", "mhla_joint_attention_reference"]


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
    normalize: bool | str = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Same contract as :func:`mhla_attention`, computed token pair by token pair.

    ``out_t = Σ_s W[b(t), b(s)] (q̂_t · k̂_s) v_s``, divided by

    * ``max(Σ_s W[b(t), b(s)] (q_t · k_s), 0) + eps`` when ``normalize`` is ``True`` / ``"denominator"``;
    * ``max(Σ_s W[b(t), b(s)] (q_(b(s), w(t)) · k_s), 0) + eps`` when ``normalize="scalar_mixed_denominator"``
      (released DiT-MHLA), where ``q_(j, w)`` is the query of the token at within-block position ``w``
      (row-major offsets inside the block) of block ``j``: each pair ``(t, s)`` uses the query of
      ``t``'s counterpart in ``s``'s block. Needs equal-size blocks.

    Blocks that receive no token (a layout with more blocks than the grid has tokens on an axis)
    simply never appear in ``b(t)`` or ``b(s)``.

    Shapes: ``q, k`` ``(B, N, H, D)``, ``v`` ``(B, N, H, Dv)`` -> ``(B, N, H, Dv)``.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, mixing, q_rot, k_rot)
    normalize = normalization_mode(normalize)
    if normalize == "scalar_mixed_denominator":
        check_equal_blocks(grid, layout)
    block = token_block_ids(grid, layout, device=q.device)
    pair_weight = mixing[..., block[:, None], block[None, :]]  # (N, N) or (H, N, N)
    return _pair_attention(q, k, v, pair_weight, q_rot, k_rot, normalize, eps, grid, layout)


def mhla_causal_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    *,
    decay: torch.Tensor | float | None = None,
    mean_fold: bool = False,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Same contract as :func:`~mhla_diffusion.ops.causal.mhla_causal_attention`, computed token pair by token pair.

    The token pair ``(t, s)`` gets the weight, from the temporal block rows ``r(t)``, ``r(s)`` (block index over
    ``S``, the blocks per row) and the spatial places ``p(t)``, ``p(s)`` (block index modulo ``S``) of its tokens,
    with ``Δ = r(t) - r(s)`` and ``K = mixing.shape[-3] - 2``::

        0                                       Δ < 0 (a later row)
        mixing[Δ, p(t), p(s)]                   0 <= Δ <= K
        γ^(Δ - K - 1) mixing[K + 1, p(t), p(s)] Δ > K        (γ = ``decay``, 1 when None)
        mixing[K + 1, p(t), p(s)] / (r(t) - K)  Δ > K        with ``mean_fold``

    and then ``out_t = Σ_s w_ts (q̂_t · k̂_s) v_s / (max(Σ_s w_ts (q_t · k_s), 0) + eps)`` as in
    :func:`mhla_attention_reference`. Shapes: ``q, k`` ``(B, N, H, D)``, ``v`` ``(B, N, H, Dv)`` -> ``(B, N, H, Dv)``.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, None, q_rot, k_rot)
    window, normalize = check_causal_arguments(mixing, layout, q.shape[2], decay, normalize, mean_fold)
    per_row = math.prod(layout[1:])
    block = token_block_ids(grid, layout, device=q.device)
    row, place = block // per_row, block % per_row
    delta = row[:, None] - row[None, :]  # (N, N)
    pair_weight = mixing[..., delta.clamp(0, window + 1), place[:, None], place[None, :]]  # (N, N) or (H, N, N)
    if decay is not None:
        gamma = torch.as_tensor(decay, dtype=mixing.dtype, device=q.device)
        pair_weight = pair_weight * gamma[..., None, None] ** (delta - window - 1).clamp(min=0).to(mixing.dtype)
    if mean_fold:  # a query of row r(t) > K folds the r(t) - K rows before its window
        pair_weight = torch.where(
            delta > window, pair_weight / (row[:, None] - window).clamp(min=1).to(mixing.dtype), pair_weight
        )
    pair_weight = torch.where(delta >= 0, pair_weight, 0.0)
    return _pair_attention(q, k, v, pair_weight, q_rot, k_rot, normalize, eps, grid, layout)


def mhla_joint_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    text_q: torch.Tensor,
    text_k: torch.Tensor,
    text_v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    *,
    text_mask: torch.Tensor | None = None,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`~mhla_diffusion.ops.joint.mhla_joint_attention` (features only), token pair by pair.

    The image tokens and then the text tokens form one sequence; token ``t`` lies in block ``b(t)`` (an image
    block, or ``M`` for every text token), and the pair ``(t, s)`` weighs ``W[b(t), b(s)]``, or 0 when ``s`` is a
    padded text token. Text tokens are their own rotated features. Returns (image output, text output).
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, None, q_rot, k_rot)
    check_joint_arguments(q, text_q, text_k, text_v, text_mask, layout, mixing, v)
    normalize = normalization_mode(normalize)
    n, length = q.shape[1], text_q.shape[1]
    text_block = torch.full((length,), math.prod(layout), device=q.device)
    block = torch.cat([token_block_ids(grid, layout, device=q.device), text_block])
    pair_weight = mixing[..., block[:, None], block[None, :]]  # (N + L, N + L) or (H, N + L, N + L)
    if text_mask is not None:  # padded text tokens are no keys: (B, 1 or H, N + L, N + L)
        keys = torch.cat([text_mask.new_ones(q.shape[0], n), text_mask], dim=1)
        pair_weight = pair_weight.reshape(1, -1, n + length, n + length) * keys[:, None, None, :]
    joint_q, joint_k, joint_v = (torch.cat([a, b], dim=1) for a, b in ((q, text_q), (k, text_k), (v, text_v)))
    q_hat = None if q_rot is None else torch.cat([q_rot, text_q], dim=1)
    k_hat = None if k_rot is None else torch.cat([k_rot, text_k], dim=1)
    out = _pair_attention(joint_q, joint_k, joint_v, pair_weight, q_hat, k_hat, normalize, eps, grid, layout)
    return out[:, :n], out[:, n:]


def _pair_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pair_weight: torch.Tensor,
    q_rot: torch.Tensor | None,
    k_rot: torch.Tensor | None,
    normalize: str,
    eps: float,
    grid: tuple[int, ...],
    layout: tuple[int, ...],
) -> torch.Tensor:
    """The references' arithmetic from the token-pair weights ``pair_weight`` ``(N, N)`` or ``(H, N, N)``."""
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    q_hat = (q if q_rot is None else q_rot).to(dtype)
    k_hat = (k if k_rot is None else k_rot).to(dtype)
    pair_weight = pair_weight.to(dtype)
    if pair_weight.ndim == 2:
        pair_weight = pair_weight.unsqueeze(0)

    scores = torch.einsum("bthd,bshd->bhts", q_hat, k_hat) * pair_weight
    out = torch.einsum("bhts,bshe->bthe", scores, v.to(dtype))
    if normalize != "none":
        plain = torch.einsum("bthd,bshd->bhts", q.to(dtype), k.to(dtype))  # q_t · k_s
        if normalize == "scalar_mixed_denominator":
            # row t of pair (t, s) becomes q_(b(s), w(t)) · k_s: the counterpart of t in s's block
            counterpart = _counterparts(grid, layout, q.device)  # (N, N)
            plain = plain.gather(2, counterpart.expand(plain.shape))
        plain = plain * pair_weight
        out = out / (plain.sum(dim=-1).clamp_min(0) + eps).transpose(1, 2).unsqueeze(-1)
    return out.to(v.dtype)


def _counterparts(grid: tuple[int, ...], layout: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``(N, N)`` table: entry ``[t, s]`` is the token at ``t``'s within-block position in ``s``'s block.

    Written from the coordinates alone (equal blocks of ``grid[a] // layout[a]`` tokens per axis), not
    from the fast operator's block plan.
    """
    coords = torch.cartesian_prod(*(torch.arange(g, device=device) for g in grid)).reshape(-1, len(grid))
    extent = torch.tensor([g // b for g, b in zip(grid, layout)], device=device)
    block_coord, offset = coords // extent, coords % extent  # (N, axes) each
    # token of (block coordinates of s, offsets of t), back to a row-major token index
    pair = block_coord[None, :, :] * extent + offset[:, None, :]  # (N_t, N_s, axes)
    index = torch.zeros(pair.shape[:2], dtype=torch.long, device=device)
    for axis, size in enumerate(grid):
        index = index * size + pair[..., axis]
    return index
