"""The numerator of MHLA by token pairs, for layouts whose blocks hold a token or two.

The operator's numerator for a query token ``t`` of block ``o`` is ``q̂_t · S̃_o`` with the mixed key-value summary
``S̃_o = Σ_j W[o, j] S_j``. Mixing ``(D, Dv)`` summaries costs ``M_q M_k D Dv`` per head. The same numerator, by
token pairs, is ``Σ_s W[o, b(s)] (q̂_t · k̂_s) v_s``, which costs ``N_q N_k (D + Dv)``: with ``P`` tokens per block,
``P_q P_k (D + Dv)`` against ``D Dv`` per pair of blocks. When blocks are a token or two (a causal layout with one
block per latent frame and spatial place, as the embedded long-video model has), the pair form is many times
cheaper: at ``P = 1``, ``D = Dv = 32`` it is 16x fewer multiplications. The denominator keeps the block form (mixing
``(D,)`` key sums costs ``M_q M_k D``, less than either).

:func:`pair_numerator` is used by the block math (:mod:`~mhla_diffusion.ops.attention`) when :func:`pair_form_pays`
says so; both forms are checked against :mod:`~mhla_diffusion.ops.naive` by the same tests.
"""

from __future__ import annotations

import torch

__all__ = ["PAIR_SCORE_ELEMENTS", "pair_form_pays", "pair_numerator"]

#: The pair form holds a ``(B, H, N_q, N_k)`` score matrix; above this many elements the block form is used.
PAIR_SCORE_ELEMENTS = 1 << 26


def pair_form_pays(
    batch_heads: int, query_shape: tuple[int, int], key_shape: tuple[int, int], head_dim: int, value_dim: int
) -> bool:
    """Whether the pair form costs fewer multiplications than mixing the summaries, with its score matrix in
    budget. ``query_shape``, ``key_shape``: ``(blocks, tokens per block)`` of the query and key sides."""
    (m_q, p_q), (m_k, p_k) = query_shape, key_shape
    # x2: the pair form's products are short (D deep) and it scales the scores elementwise; measured on a 2-core
    # CPU at D = Dv = 32 (forward and backward of teacher forcing): 5.7x faster at P = 1, 1.3x slower at P = 4
    pairs = 2 * p_q * p_k * (head_dim + value_dim)
    # the block form also builds the summaries (m_k p_k D Dv) before mixing them (m_q m_k D Dv)
    blocks = m_q * m_k * head_dim * value_dim + m_k * p_k * head_dim * value_dim
    return pairs * m_q * m_k < blocks and batch_heads * m_q * p_q * m_k * p_k <= PAIR_SCORE_ELEMENTS


def pair_numerator(
    q_num: torch.Tensor, k_num: torch.Tensor, values: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``Σ_s W[o, b(s)] (q̂_t · k̂_s) v_s`` for every query slot, block-major.

    Args:
        q_num: the queries' numerator features ``(B, H, M_q, P_q, D)``.
        k_num: the keys' numerator features ``(B, H, M_k, P_k, D)``.
        values: ``(B, H, M_k, P_k, Dv)``, zero in padded slots (so padded keys add nothing).
        weights: the mixing rows of the query blocks, ``(B * H, M_q, M_k)``.

    Returns:
        ``(B, H, M_q, P_q, Dv)`` in the promoted dtype of the inputs, at least float32.
    """
    batch, heads, m_q, p_q, _ = q_num.shape
    m_k, p_k = k_num.shape[2:4]
    # half inputs: the scores are summed over N_k products, so they are kept in float32 (the block form's GEMMs
    # accumulate in float32 too)
    dtype = torch.promote_types(torch.promote_types(q_num.dtype, values.dtype), torch.float32)
    scores = q_num.to(dtype).flatten(2, 3) @ k_num.to(dtype).flatten(2, 3).transpose(-1, -2)  # (B, H, N_q, N_k)
    scores = scores.view(batch, heads, m_q, p_q, m_k, p_k) * weights.to(dtype).view(batch, heads, m_q, 1, m_k, 1)
    out = scores.view(batch, heads, m_q * p_q, m_k * p_k) @ values.to(dtype).flatten(2, 3)
    return out.view(batch, heads, m_q, p_q, -1)
