"""One chunk of a block-causal MHLA stream, eager: its output from its tokens and the block summaries carried from
the chunks before (:func:`causal_chunk_output`), and the setup the causal operators share (:func:`_block_features`).

:mod:`~mhla_diffusion.ops.causal` builds the chunk's mixing rows and the state around it; the fused form of the same
function is :func:`~mhla_diffusion.ops.fused_causal.fused_causal_chunk`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .attention import _block_output, _Blocks, _Summaries, block_sums, without_autocast
from .block_layout import BlockPlan

__all__ = ["causal_chunk_output"]


def needs_grad(tensors: Sequence[torch.Tensor | float | None]) -> bool:
    """Whether autograd records through any of ``tensors`` here (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _block_features(
    plan: BlockPlan,
    dtype: torch.dtype,
    tensors: Sequence[torch.Tensor | float | None],
    feature_eps: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    den: bool,
) -> tuple[_Blocks, Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]], float]:
    """What the causal operators' block math starts from: the regrouping :class:`_Blocks` of ``plan`` (writing in
    place unless one of ``tensors`` needs gradients), ``features(x, x_rot)`` (block-major numerator and denominator
    features, as :meth:`_Blocks.features`) and the denominator's ``shift`` (see ``_mhla_blocks``)."""
    inplace = not needs_grad(tensors)
    blocks = _Blocks(plan, dtype, inplace)
    tables = None if feature_eps is None or rotary is None else blocks.rotary_tables(rotary, feature_eps)
    shift = 0.0 if tables is None else float(feature_eps)

    def features(x: torch.Tensor, x_rot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return blocks.features(x, x_rot, feature_eps, tables, den)

    return blocks, features, shift


def causal_chunk_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    weights: torch.Tensor,
    carried: Sequence[torch.Tensor],
    carried_sums: torch.Tensor | None,
    normalize: str,
    eps: float,
    feature_eps: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's block-causal output from its tokens and the carried block summaries (eager; the plain form of
    :func:`~mhla_diffusion.ops.fused_causal.fused_causal_chunk`).

    ``carried``: the carried summaries ``(B, H, C_i, D, Dv)`` in at least float32, in the order of the first
    ``Σ C_i`` columns of ``weights`` (``(M_c, C + M_c)`` or per head ``(H, M_c, C + M_c)``: the carried blocks,
    then the chunk's ``M_c`` blocks); ``carried_sums`` ``(B, H, C, D)`` their key sums (``None`` without a
    denominator). Returns the output ``(B, N_c, H, Dv)`` in ``v``'s dtype, and the chunk's own block summaries
    ``(B, H, M_c, D, Dv)`` and key sums ``(B, H, M_c, D)`` (``None`` without a denominator), which the state
    after the chunk is made from."""
    batch, heads = q.shape[0], q.shape[2]
    dtype = torch.promote_types(q.dtype, v.dtype)
    sum_dtype = torch.promote_types(dtype, torch.float32)
    den = normalize != "none"
    with without_autocast(q.device):
        tensors = (q, k, v, q_rot, k_rot, weights, *carried, carried_sums)
        blocks, features, shift = _block_features(plan, dtype, tensors, feature_eps, rotary, den)
        kv, key_sum = block_sums(blocks, lambda: features(k, k_rot), lambda: blocks.gather(v, zero_padding=True), shift)
        kv = kv.to(sum_dtype)
        weights = weights.to(sum_dtype).expand(batch, heads, *weights.shape[-2:])
        weights = weights.reshape(batch * heads, *weights.shape[-2:])
        history_sums = None if key_sum is None else torch.cat([carried_sums, key_sum.to(sum_dtype)], dim=2)
        summaries = _Summaries(weights, history_sums)
        summaries.mixed = _mix_rows(weights, (*carried, kv)).to(dtype)
        out = _block_output(blocks, summaries, lambda: features(q, q_rot), normalize, eps, shift, v.dtype)
    return out, kv, key_sum


def _mix_rows(weights: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ_j W[o, j] X_j`` over blocks given in ``parts`` ``(B, H, C_i, D, Dv)`` (the fold, the recent rows, the
    chunk's), without joining them: one product per part, added in place. ``weights`` ``(B * H, M_c, Σ C_i)``
    -> ``(B, H, M_c, D, Dv)``."""
    batch, heads = parts[0].shape[:2]
    tail = parts[0].shape[-2:]
    flat = (batch * heads, -1, tail.numel())
    mixed, start = None, 0
    for part in parts:
        cols = weights[..., start : start + part.shape[2]]
        start += cols.shape[-1]
        if cols.shape[-1]:
            x = part.reshape(flat)
            mixed = torch.bmm(cols, x) if mixed is None else mixed.baddbmm(cols, x)
    return mixed.view(batch, heads, -1, *tail)
