"""Teacher forcing for block-causal MHLA: every chunk of a clip denoised in one pass, as a stream would denoise it.

A stream denoises chunk ``c`` against a state advanced with the *clean* chunks before it
(:func:`~mhla_diffusion.ops.causal.mhla_causal_step`). Training a causal model the way it streams (Self-Forcing's
and CausVid's "teacher forcing") runs the clip twice: a clean copy (its context) and a noisy copy (what is
denoised). A query of the noisy copy's temporal block row ``r``, in chunk ``c`` whose first row is ``r_c``, mixes

* the clean copy's rows ``r' < r_c`` with ``W[(r, s), (r', s')]`` of offset ``Δ = r - r'`` (through the per-offset
  matrices, and past the window the fold: summed, decayed or averaged, as in :mod:`~mhla_diffusion.ops.causal`);
* the noisy copy's rows ``r_c <= r' <= r`` (its own chunk, block-causally) with the same ``W``;

and nothing else. Both copies keep the same positions (the same RoPE tables). So the key rows are the two copies'
block rows, ``E = 2R`` of them, whose summaries one ``(M, 2M)`` block matrix mixes (blocks of a token or two:
token pairs, :mod:`~mhla_diffusion.ops.block_pairs`), never a ``2N x 2N`` one, and the cost stays about that of one
MHLA pass per copy. The clean
copy's own output is one block-causal pass over it
(:func:`~mhla_diffusion.ops.causal.mhla_causal_attention`): in a stream it is the advance forward of each chunk.

:func:`mhla_causal_teacher_forcing` returns the noisy copy's output; ``tests/attention/test_teacher_forcing.py``
checks it, chunk by chunk, against the stream's denoising step with a state advanced by the clean chunks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .attention import check_feature_arguments, validate_attention_inputs
from .block_layout import BlockPlan, block_plan
from .causal import causal_block_output, check_causal_arguments

__all__ = ["mhla_causal_teacher_forcing", "teacher_forcing_offsets"]


def teacher_forcing_offsets(chunk_rows: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The temporal offsets ``(R, 2R)`` of the noisy copy's query rows against the clean copy's rows, then the noisy
    copy's own: ``r - r'`` where the key row is visible (a clean row of an earlier chunk, a noisy row of the same
    chunk at or before ``r``), ``-1`` where it is not. ``chunk_rows``: temporal block rows per chunk, in order."""
    if not chunk_rows or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in chunk_rows):
        raise ValueError(f"`chunk_rows` must be positive numbers of temporal block rows, got {list(chunk_rows)!r}")
    rows = sum(chunk_rows)
    starts = torch.repeat_interleave(
        torch.tensor([sum(chunk_rows[:c]) for c in range(len(chunk_rows))], device=device),
        torch.tensor(list(chunk_rows), device=device),
    )  # (R,): the first row of each row's chunk
    r = torch.arange(rows, device=device)
    delta = r[:, None] - r[None, :]
    clean = torch.where(r[None, :] < starts[:, None], delta, -1)
    noisy = torch.where((r[None, :] >= starts[:, None]) & (delta >= 0), delta, -1)
    return torch.cat([clean, noisy], dim=1)


def mhla_causal_teacher_forcing(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    chunk_rows: Sequence[int],
    *,
    decay: torch.Tensor | float | None = None,
    mean_fold: bool = False,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    context_k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
    plan: BlockPlan | None = None,
    feature_eps: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The noisy copy's block-causal MHLA under teacher forcing (see the module docstring).

    Args:
        q, k, v: the noisy copy's queries and keys ``(B, N, H, D)`` and values ``(B, N, H, Dv)``.
        context_k, context_v: the clean copy's keys and values, same shapes (its queries are not needed here).
        grid, layout: the clip's token grid and block layout (first axis: time, its blocks the temporal rows).
        mixing, decay, mean_fold, normalize, eps, plan: as for :func:`~mhla_diffusion.ops.causal.mhla_causal_attention`.
        chunk_rows: temporal block rows per chunk, summing to ``layout[0]`` (a first chunk may differ).
        q_rot, k_rot, context_k_rot: the rotated numerator features of ``q``, ``k`` and ``context_k`` (give all
            three or none); or ``feature_eps`` and ``rotary`` (tables of the clip's positions, shared by both
            copies) for the processors' feature path.

    Returns:
        ``(B, N, H, Dv)`` in ``v``'s dtype: chunk by chunk, what the stream's denoising step gives against a state
        advanced with the clean copy's earlier chunks.
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, None, q_rot, k_rot, plan)
    if context_k.shape != k.shape or context_v.shape != v.shape:
        raise ValueError(
            f"the clean copy's keys {tuple(context_k.shape)} and values {tuple(context_v.shape)} must have the noisy "
            f"copy's shapes {tuple(k.shape)} and {tuple(v.shape)}: both copies are the same clip"
        )
    if (k_rot is None) != (context_k_rot is None):
        raise ValueError("give `context_k_rot` exactly when `k_rot` is given: both copies' keys are rotated alike")
    _, normalize = check_causal_arguments(mixing, layout, q.shape[2], decay, normalize, mean_fold)
    check_feature_arguments(q, q_rot, k_rot, feature_eps, rotary)
    rows = layout[0]
    if sum(chunk_rows) != rows:
        raise ValueError(f"`chunk_rows` {list(chunk_rows)} must add up to the layout's {rows} temporal block rows")
    offsets = teacher_forcing_offsets(chunk_rows, q.device)
    if plan is None:
        plan = block_plan(grid, layout, device=q.device)
    mean_rows = torch.arange(rows, device=q.device) if mean_fold else None
    copies = [(context_k, context_k_rot, context_v), (k, k_rot, v)]  # the clean copy's rows first
    return causal_block_output(
        q, copies, offsets, plan, mixing, decay, mean_rows, q_rot, normalize, eps, feature_eps, rotary
    )
