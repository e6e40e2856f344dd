"""Initial values of MHLA's block-mixing coefficients.

Entry ``W[o, j]`` is the weight with which the key-value summary of block ``j`` feeds query block
``o``. Block centres sit on the block grid with unit spacing (a step along any axis counts 1, however
many tokens a block spans), and the transforms turn centre distances into weights that favour nearby
blocks.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal, Sequence

import torch

from ..utils.choices import MIXING_TRANSFORMS

__all__ = ["MIXING_TRANSFORMS", "block_distances", "mixing_init"]


def block_distances(layout: Sequence[int]) -> torch.Tensor:
    """Euclidean distances between block centres in block units, shape ``(M, M)`` (float64)."""
    layout = tuple(int(b) for b in layout)
    if not layout or any(b < 1 for b in layout):
        raise ValueError(f"`layout` must be a non-empty sequence of positive ints, got {layout}")
    centres = torch.tensor(list(itertools.product(*(range(b) for b in layout))), dtype=torch.float64)
    return torch.cdist(centres, centres)


def mixing_init(
    layout: Sequence[int],
    transform: str = "linear",
    *,
    normalization: Literal["column", "row"] = "column",
    exp_sigma: float = 3.0,
    local_threshold: float = 1.5,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Distance-based initial mixing matrix, shape ``(M, M)``; row ``o`` holds query block ``o``'s weights.

    ``normalization="column"`` follows the released code: distances are scaled by the single largest
    distance of the whole matrix and every column (the weights one source block sends out) sums to 1;
    ``gaussian`` is left unnormalised (diagonal 1), as there.

    ``normalization="row"`` is the paper's variant: distances are scaled by each row's own largest
    distance and every row (the weights one query block receives) sums to 1, for every transform.

    Transforms of the scaled distance ``d = D / D_max``:
    ``linear`` ``1 - d``; ``cos`` ``cos(pi/4 * d)``; ``exp`` ``exp(-D / exp_sigma)``;
    ``gaussian`` ``exp(-D^2 / (2 sigma^2))`` with ``sigma = D_max / 3``;
    ``local`` ``1[D <= local_threshold]``. A single block gets ``[[1]]``.
    """
    if transform not in MIXING_TRANSFORMS:
        raise ValueError(f"unknown `transform` {transform!r}: choose one of {', '.join(MIXING_TRANSFORMS)}")
    if normalization not in ("column", "row"):
        raise ValueError(
            f"unknown `normalization` {normalization!r}: choose 'column' (reference code) or 'row' (paper)"
        )
    if exp_sigma <= 0:
        raise ValueError(f"`exp_sigma` must be > 0, got {exp_sigma}")
    dist = block_distances(layout)
    if normalization == "row":
        d_max = dist.amax(dim=1, keepdim=True)
    else:
        d_max = dist.max().expand(1, 1)
    d_max = torch.where(d_max > 0, d_max, torch.ones_like(d_max))  # one block: every distance is 0

    if transform == "linear":
        weights = 1.0 - dist / d_max
    elif transform == "cos":
        weights = torch.cos(math.pi / 4 * dist / d_max)
    elif transform == "exp":
        weights = torch.exp(-dist / exp_sigma)
    elif transform == "gaussian":
        sigma = d_max / 3.0
        weights = torch.exp(-(dist**2) / (2 * sigma**2))
    else:  # local
        weights = (dist <= local_threshold).to(torch.float64)

    if normalization == "row":
        weights = weights / weights.sum(dim=1, keepdim=True)
    elif transform != "gaussian":
        weights = weights / weights.sum(dim=0, keepdim=True)
    return weights.to(dtype)
