"""The MHLA operator.

For query token ``t`` in block ``b(t)``:

    out_t = q̂_t · S̃_b(t) / (q_t · z̃_b(t) + eps)        (denominator only when ``normalize``)
    S̃_o = Σ_j W[o, j] S_j,   S_j = Σ_{s in block j} k̂_s v_sᵀ     (key-value summary of block j)
    z̃_o = Σ_j W[o, j] z_j,   z_j = Σ_{s in block j} k_s           (key sum of block j)

which equals ``Σ_s W[b(t), b(s)] (q̂_t · k̂_s) v_s`` divided by ``Σ_s W[b(t), b(s)] (q_t · k_s) + eps``,
the O(N^2) form kept in :mod:`mhla_diffusion.attention_reference`. Cost is O(N D Dv + M^2 D Dv) per
head and no N x N matrix is ever formed.

A grid with fewer tokens than blocks on some axis leaves *empty* blocks (see
:mod:`mhla_diffusion.block_layout`): their ``S_j`` and ``z_j`` are zero, so they add nothing to any
mixed sum, and they hold no query (their padded slots are dropped, with denominator 1 so that no
``0 / 0`` reaches the gradients).

The released DiT-MHLA (``MHLA4DiT``) divides instead by a mix of per-block *scalars*
(``normalize="scalar_mixed_denominator"``): for the token ``t = (o, w)`` at within-block position
``w`` of block ``o``,

    den(o, w) = Σ_j W[o, j] (q_(j,w) · z_j) + eps

where ``q_(j,w)`` is the query of the token at the same position ``w`` in block ``j``. It equals the
paper's denominator only when ``W`` is diagonal, and it needs equal-size blocks (a layout that
divides the grid), so that position ``w`` exists in every block. Extra cost O(N D + M^2 P).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import ContextManager, Sequence

import torch

from .block_layout import BlockPlan, block_plan, num_blocks, validate_grid_layout
from .cpu_memory import retain_freed_memory_on_first_use
from .geometry import check_equal_blocks

__all__ = ["mhla_attention", "normalization_mode", "validate_attention_inputs", "without_autocast"]

_MODES = {True: "denominator", False: "none", "denominator": "denominator", "none": "none",
          "scalar_mixed_denominator": "scalar_mixed_denominator"}


def normalization_mode(normalize: bool | str) -> str:
    """``"denominator"``, ``"none"`` or ``"scalar_mixed_denominator"`` for the operator's ``normalize``
    argument (``True`` / ``False`` mean the first two)."""
    try:
        return _MODES[normalize]
    except (KeyError, TypeError):
        raise ValueError(
            f"`normalize` must be True (paper denominator), False (none) or 'scalar_mixed_denominator' "
            f"(released DiT), or the names 'denominator' / 'none'; got {normalize!r}"
        ) from None


def validate_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    q_rot: torch.Tensor | None,
    k_rot: torch.Tensor | None,
    plan: BlockPlan | None = None,
    num_tokens: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check the operator's arguments; raise ``ValueError`` naming the first bad one.

    With a ``plan`` (built by :func:`~mhla_diffusion.block_layout.block_plan`, which validated its
    grid and layout), grid and layout are only compared with the plan's, not validated again.
    ``num_tokens`` is the grid's token count, default ``N`` of ``q``; the context-parallel operator
    passes the whole sequence's count, since its ``q`` holds only one rank's tokens.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"`{name}` must be a 4-D tensor (B, N, H, D), got {getattr(t, 'shape', type(t))}")
    if k.shape != q.shape:
        raise ValueError(f"`k` shape {tuple(k.shape)} must equal `q` shape {tuple(q.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"`v` shape {tuple(v.shape)} must share (B, N, H) with `q` {tuple(q.shape)}")
    for name, t in (("q_rot", q_rot), ("k_rot", k_rot)):
        if t is not None and t.shape != q.shape:
            raise ValueError(f"`{name}` shape {tuple(t.shape)} must equal `q` shape {tuple(q.shape)}")
    num_tokens = q.shape[1] if num_tokens is None else num_tokens
    if plan is None:
        grid, layout = validate_grid_layout(grid, layout, num_tokens=num_tokens)
    else:
        grid, layout = _check_plan(plan, grid, layout, num_tokens, q.device)
    m, heads = num_blocks(layout), q.shape[2]
    if not isinstance(mixing, torch.Tensor) or mixing.shape not in ((m, m), (heads, m, m)):
        raise ValueError(
            f"`mixing` must have shape ({m}, {m}) or per-head ({heads}, {m}, {m}) for layout {layout} "
            f"and {heads} heads, got {tuple(getattr(mixing, 'shape', ()))}"
        )
    return grid, layout


def _check_plan(
    plan: BlockPlan, grid: Sequence[int], layout: Sequence[int], num_tokens: int, device: torch.device
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check that a precomputed ``plan`` is the one for ``grid``, ``layout``, ``N`` and ``device``."""
    if not isinstance(plan, BlockPlan):
        raise ValueError(f"`plan` must be a BlockPlan from block_plan(grid, layout, device), got {type(plan).__name__}")
    try:
        grid, layout = tuple(int(g) for g in grid), tuple(int(b) for b in layout)
    except TypeError:
        return validate_grid_layout(grid, layout, num_tokens=num_tokens)  # raises, naming the bad argument
    if grid != plan.grid or layout != plan.layout:
        raise ValueError(
            f"`plan` was built for grid {plan.grid} and layout {plan.layout}, but the call has grid {grid} and "
            f"layout {layout}: build it with block_plan(grid, layout, device) for this call"
        )
    if math.prod(grid) != num_tokens:
        raise ValueError(
            f"`grid` {grid} has {math.prod(grid)} tokens but the inputs have N={num_tokens}: the grid's product must equal N"
        )
    if plan.device != device:
        raise ValueError(f"`plan` is on {plan.device} but the inputs are on {device}: build it on the inputs' device")
    return grid, layout


def without_autocast(device: torch.device) -> ContextManager:
    """A context in which ``device``'s autocast is off, so the operator's products run in the dtype it
    chose (float32 for half inputs) whether or not the caller enabled ``torch.autocast`` (as
    accelerate's bf16 mixed precision does): training and inference then compute alike. Devices
    without autocast (``meta``) get a context that does nothing."""
    if not torch.amp.is_autocast_available(device.type):
        return nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32 for half types, keep float32/float64 as they are."""
    return torch.promote_types(dtype, torch.float32)


def mhla_attention(
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
    heads_per_chunk: int | None = None,
    plan: BlockPlan | None = None,
) -> torch.Tensor:
    """Multi-head linear attention over token blocks.

    Args:
        q, k: feature-mapped (non-negative) queries and keys, ``(B, N, H, D)``.
        v: values, ``(B, N, H, Dv)``.
        grid: token-grid sizes (1 to 3 axes, product ``N``); tokens in row-major order.
        layout: blocks per grid axis; token coordinate ``c`` on an axis of size ``G`` cut into ``L``
            blocks lies in block ``floor(c * L / G)``; blocks are numbered row-major.
        mixing: ``(M, M)`` or per-head ``(H, M, M)``; row ``o`` weighs the key blocks for query block ``o``.
        q_rot, k_rot: rotated features for the numerator (RoPE after the feature map); default ``q``, ``k``.
        normalize: ``True`` (or ``"denominator"``): divide by the paper's mixed denominator
            ``q_t · z̃_b(t) + eps``; ``False`` (or ``"none"``): no denominator;
            ``"scalar_mixed_denominator"``: divide the token ``(o, w)`` (position ``w`` of block ``o``)
            by the released DiT's ``Σ_j W[o, j] (q_(j,w) · z_j) + eps``, computed as the ``(B, H, M, P)``
            scalars ``q_(j,w) · z_j`` mixed over ``j`` by ``W``; it needs a layout that divides
            ``grid`` (equal-size blocks) and raises ``ValueError`` naming grid, layout and a fix
            otherwise. Denominators use the un-rotated ``q``, ``k``.
        eps: added to the denominator.
        heads_per_chunk: process this many heads at a time to bound the working memory (default: all).
        plan: the :class:`~mhla_diffusion.block_layout.BlockPlan` of ``grid`` and ``layout`` on the
            inputs' device, built once and reused across calls (the MHLA processors get one per
            transformer forward from their grid context); default: built here. A plan for another
            grid, layout or device raises ``ValueError``. The result does not depend on it.

    ``layout`` may have more blocks than ``grid`` has tokens on an axis: the blocks that receive no
    token are empty (zero key-value summary and key sum, no query), as in the reference.

    On a CPU, the first call in a process makes glibc keep freed memory for reuse (logged; see
    :mod:`mhla_diffusion.cpu_memory`, ``MHLA_KEEP_MALLOC=1`` opts out): otherwise every large
    temporary of a call at video length is page-faulted in again, which costs more than the arithmetic.

    Returns:
        ``(B, N, H, Dv)`` in ``v``'s dtype; bf16/fp16 inputs are accumulated in float32, inside
        ``torch.autocast`` too (the operator's products never take autocast's lower precision).
    """
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, mixing, q_rot, k_rot, plan)
    normalize = normalization_mode(normalize)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        retain_freed_memory_on_first_use()  # once per process, logged; MHLA_KEEP_MALLOC=1 opts out (cpu_memory)
    if heads_per_chunk is not None and heads_per_chunk < 1:
        raise ValueError(f"`heads_per_chunk` must be >= 1, got {heads_per_chunk}")
    if plan is None:
        plan = block_plan(grid, layout, device=q.device)
    if normalize == "scalar_mixed_denominator" and plan.valid is not None:  # the plan knows if blocks are uneven
        check_equal_blocks(grid, layout)
    heads = q.shape[2]
    with without_autocast(q.device):
        if heads_per_chunk is None or heads_per_chunk >= heads:
            return _mhla_blocks(q, k, v, plan, mixing, q_rot, k_rot, normalize, eps)
        out = v.new_empty(v.shape)
        for start in range(0, heads, heads_per_chunk):
            h = slice(start, start + heads_per_chunk)
            chunk = lambda x: None if x is None else x[:, :, h]  # noqa: E731
            out[:, :, h] = _mhla_blocks(
                q[:, :, h], k[:, :, h], v[:, :, h], plan, mixing if mixing.ndim == 2 else mixing[h],
                chunk(q_rot), chunk(k_rot), normalize, eps,
            )
        return out


def _mhla_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    mixing: torch.Tensor,
    q_rot: torch.Tensor | None,
    k_rot: torch.Tensor | None,
    normalize: str,
    eps: float,
) -> torch.Tensor:
    """The operator on validated inputs (see :func:`mhla_attention`); ``normalize`` is a mode name."""
    batch, n, heads, _ = q.shape
    dtype = _compute_dtype(torch.promote_types(q.dtype, v.dtype))
    m, p = plan.num_blocks, plan.block_len
    # Without autograd the temporaries can be updated in place, which keeps peak memory low.
    inplace = not (torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, q_rot, k_rot, mixing)
    ))

    def to_blocks(x: torch.Tensor, zero_padding: bool = False) -> torch.Tensor:
        # (B, N, H, d) -> (B, H, M, P, d): one gather, head-major so the products below are plain
        # batched matmuls; padded slots are zeroed where they would add to a sum.
        xb = x.transpose(1, 2).index_select(2, plan.gather).view(batch, heads, m, p, x.shape[-1]).to(dtype)
        if zero_padding and plan.valid is not None:
            mask = plan.valid[:, :, None].to(dtype)
            xb = xb.mul_(mask) if inplace else xb * mask
        return xb

    mix = mixing.to(dtype)
    if mix.ndim == 3:
        mix = mix[None]  # (1, H, M, M) against (B, H, M, ...)

    k_hat = to_blocks(k if k_rot is None else k_rot, zero_padding=True)
    v_blocks = to_blocks(v)
    kv_summary = k_hat.transpose(-1, -2) @ v_blocks  # S_j: (B, H, M, D, Dv)
    if normalize != "none":
        key_sum = (k_hat if k_rot is None else to_blocks(k, zero_padding=True)).sum(dim=3)  # z_j: (B, H, M, D)
    del k_hat, v_blocks
    d, dv = kv_summary.shape[-2:]
    mixed_summary = (mix @ kv_summary.reshape(batch, heads, m, d * dv)).view(batch, heads, m, d, dv)  # S̃_o
    del kv_summary
    q_hat = to_blocks(q if q_rot is None else q_rot)
    out = q_hat @ mixed_summary  # (B, H, M, P, Dv)
    del mixed_summary

    if normalize != "none":
        q_plain = q_hat if q_rot is None else to_blocks(q)
        del q_hat
        if normalize == "denominator":
            denominator = torch.einsum("bhmpd,bhmd->bhmp", q_plain, mix @ key_sum)  # q_(o,w) · z̃_o
        else:  # scalar_mixed_denominator (equal blocks: slot p of every block is the same position w)
            scalars = torch.einsum("bhjpd,bhjd->bhjp", q_plain, key_sum)  # q_(j,w) · z_j: (B, H, M, P)
            denominator = mix @ scalars  # Σ_j W[o, j] q_(j,w) · z_j
            del scalars
        denominator = denominator.unsqueeze(-1)
        del q_plain
        denominator = denominator.add_(eps) if inplace else denominator + eps
        if plan.valid is not None:  # padded slots (all of an empty block's) are dropped: divide them by 1
            padding = ~plan.valid[:, :, None]
            denominator = denominator.masked_fill_(padding, 1.0) if inplace else denominator.masked_fill(padding, 1.0)
        out = out.div_(denominator) if inplace else out / denominator

    # one gather back to token order, straight into a contiguous (B, N, H, Dv)
    out = out.view(batch, heads, m * p, dv).transpose(1, 2).index_select(1, plan.scatter)
    return out.to(v.dtype)
