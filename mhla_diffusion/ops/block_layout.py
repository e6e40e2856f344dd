"""Block layout: how the token grid is cut into MHLA's M token blocks.

Tokens lie on a row-major grid (Wan: frame, height, width; DiT: row, column). A layout gives the
number of blocks per grid axis. A token with coordinate ``c`` on an axis of size ``G`` cut into
``L`` blocks belongs to block ``floor(c * L / G)`` on that axis, so any grid works, divisible or
not; blocks are numbered row-major over the layout (first axis outermost).

An axis may have fewer tokens than blocks (``G < L``, e.g. an image's single frame under a video
layout): the same rule applies, and the blocks that receive no token are *empty*. An empty block
has zero key-value summary and key sum (it adds nothing to any mixed sum) and holds no query; in
the block plan it is a block whose padded slots are all invalid.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..utils.geometry import validate_grid_layout

__all__ = [
    "BlockPlan",
    "auto_layout",
    "block_plan",
    "estimated_cost_ratio",
    "num_blocks",
    "token_block_ids",
    "validate_grid_layout",
]


def num_blocks(layout: Sequence[int]) -> int:
    """Total number of blocks ``M`` of a layout."""
    return math.prod([int(b) for b in layout])


def _axis_segments(size: int, blocks: int) -> tuple[list[int], list[int]]:
    """Start and length of each block on one axis under the rule ``floor(c * L / G)``."""
    starts = [-(-b * size // blocks) for b in range(blocks + 1)]  # ceil(b * G / L)
    return starts[:-1], [starts[b + 1] - starts[b] for b in range(blocks)]


def token_block_ids(
    grid: Sequence[int], layout: Sequence[int], device: torch.device | str | None = None
) -> torch.Tensor:
    """Block index of every token, shape ``(N,)`` (int64), tokens in row-major grid order."""
    grid, layout = validate_grid_layout(grid, layout)
    ids = torch.zeros((), dtype=torch.long, device=device)
    for size, blocks in zip(grid, layout):
        axis = torch.arange(size, device=device) * blocks // size
        ids = ids[..., None] * blocks + axis
    return ids.reshape(-1)


@dataclass(frozen=True)
class BlockPlan:
    """Index tensors that regroup a row-major token sequence into padded blocks.

    ``gather[m * P + p]`` is the token that sits at padded slot ``p`` of block ``m``; slots past a
    block's real length repeat a token of that block (of a neighbouring block for an empty block,
    all of whose slots are padding) and are marked ``False`` in ``valid`` (``valid`` is ``None``
    when every block has exactly ``P`` tokens). ``scatter[n]`` is the padded
    slot of token ``n``, so ``blocked.index_select(dim, scatter)`` restores token order.

    ``grid`` and ``layout`` record what the plan was built for, so that a plan built once (the MHLA
    processors get one per transformer forward) can be passed to
    :func:`~mhla_diffusion.ops.attention.mhla_attention` and checked there cheaply.
    """

    num_blocks: int
    block_len: int
    gather: torch.Tensor
    scatter: torch.Tensor
    valid: torch.Tensor | None
    grid: tuple[int, ...] = ()
    layout: tuple[int, ...] = ()

    @property
    def device(self) -> torch.device:
        """Where the index tensors live."""
        return self.gather.device


def block_plan(grid: Sequence[int], layout: Sequence[int], device: torch.device | str | None = None) -> BlockPlan:
    """Build the :class:`BlockPlan` for ``grid`` cut by ``layout`` (O(N) integer work)."""
    grid, layout = validate_grid_layout(grid, layout)
    token_index = torch.zeros((), dtype=torch.long, device=device)
    slot_valid = torch.ones((), dtype=torch.bool, device=device)
    pads: list[int] = []
    for size, blocks in zip(grid, layout):
        starts, lengths = _axis_segments(size, blocks)
        pad = max(lengths)
        pads.append(pad)
        offset = torch.arange(pad, device=device)
        start = torch.tensor(starts, device=device)[:, None]
        length = torch.tensor(lengths, device=device)[:, None]
        # (blocks, pad), clamped into the block; an empty block (length 0, only when size < blocks)
        # points at the token before it, which always exists (block 0 is never empty)
        coord = (start + torch.minimum(offset, length - 1)).clamp_(0, size - 1)
        valid = offset < length
        # Grow the index as (blocks_0, ..., blocks_a, pad_0, ..., pad_a): block axes before slot axes.
        k = token_index.ndim // 2
        token_index = token_index.unsqueeze(k).unsqueeze(-1) * size + coord.reshape(
            (1,) * k + (blocks,) + (1,) * k + (pad,)
        )
        slot_valid = slot_valid.unsqueeze(k).unsqueeze(-1) & valid.reshape((1,) * k + (blocks,) + (1,) * k + (pad,))
    m, p = num_blocks(layout), math.prod(pads)
    # The padded slot of every token, by arithmetic alone (no boolean indexing: torch.compile-friendly).
    block = torch.zeros((), dtype=torch.long, device=device)
    slot = torch.zeros((), dtype=torch.long, device=device)
    for size, blocks, pad in zip(grid, layout, pads):
        coord = torch.arange(size, device=device)
        axis_block = coord * blocks // size
        axis_offset = coord - (axis_block * size + blocks - 1) // blocks  # minus the block's first coordinate
        block = block[..., None] * blocks + axis_block
        slot = slot[..., None] * pad + axis_offset
    scatter = (block * p + slot).reshape(-1)
    all_valid = all(size % blocks == 0 for size, blocks in zip(grid, layout))
    return BlockPlan(
        m, p, token_index.reshape(m * p), scatter, None if all_valid else slot_valid.reshape(m, p), grid, layout
    )


def estimated_cost_ratio(grid: Sequence[int], layout: Sequence[int]) -> float:
    """MHLA's arithmetic relative to global linear attention on ``grid``: ``M P / N + M^2 / (2 N)``.

    ``M P`` counts the padded block slots the block products run over (uneven blocks are padded to
    the largest), ``M^2 / (2 N)`` the mixing (``2 M^2 D^2`` FLOPs against ``4 N D^2`` per head).
    """
    n = math.prod(grid)
    m = math.prod(layout)
    padded = m * math.prod([-(-g // b) for g, b in zip(grid, layout)])
    return padded / n + m * m / (2 * n)


def auto_layout(grid: Sequence[int], max_blocks: int | None = None, equal_blocks: bool = False) -> tuple[int, ...]:
    """Choose a block layout for ``grid`` with ``M <= max_blocks`` (default ``floor(sqrt(N))``).

    ``M <= sqrt(N)`` keeps the mixing (``2 M^2 D^2`` FLOPs per head) within half of the key-value
    products (``4 N D^2``). Among the layouts that fit, the choice favours many blocks and
    near-cubic blocks (equal token extent on every axis, as the reference's 7x6x5 blocks on the
    21x30x50 video grid), and avoids layouts whose padded uneven blocks and mixing would cost more
    than about 1.35x global linear attention (:func:`estimated_cost_ratio`).

    ``equal_blocks=True`` considers only layouts whose entries divide the grid's axes (equal-size
    blocks, as the released DiT denominator ``scalar_mixed_denominator`` needs); the all-ones layout
    always qualifies. On DiT-XL/2's 16x16 token grid both choices give 4x4 blocks.
    """
    grid = tuple(int(g) for g in grid)
    validate_grid_layout(grid, (1,) * len(grid))
    n = math.prod(grid)
    limit = math.isqrt(n) if max_blocks is None else int(max_blocks)
    if limit < 1:
        raise ValueError(f"`max_blocks` must be >= 1, got {max_blocks}")
    best: tuple[float, tuple[int, ...]] | None = None
    for layout in itertools.product(*(range(1, g + 1) for g in grid)):
        m = math.prod(layout)
        if m > limit or (equal_blocks and any(g % b for g, b in zip(grid, layout))):
            continue
        logs = [math.log(g / b) for g, b in zip(grid, layout)]
        mean = sum(logs) / len(logs)
        anisotropy = sum((x - mean) ** 2 for x in logs) / len(logs)
        slowdown = max(0.0, estimated_cost_ratio(grid, layout) - 1.35)
        cost = 4.0 * anisotropy + math.log(limit / m) + 3.0 * slowdown
        if best is None or cost < best[0] - 1e-12:
            best = (cost, layout)
    assert best is not None  # the all-ones layout always fits
    return best[1]
