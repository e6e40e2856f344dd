"""Measurements of the moving-shapes demo clips (:mod:`mhla_diffusion.embedded`)."""

from __future__ import annotations

import numpy as np

from mhla_diffusion.embedded import BACKGROUND


def shape_mask(frames: np.ndarray) -> np.ndarray:
    """Boolean ``(F, H, W)``: pixels that are not background."""
    return (frames != np.array(BACKGROUND, dtype=np.uint8)).any(axis=-1)


def centroids(frames: np.ndarray) -> np.ndarray:
    """``(F, 2)`` ``(x, y)`` centroid of the non-background pixels of each frame."""
    mask = shape_mask(frames)
    out = []
    for m in mask:
        ys, xs = np.nonzero(m)
        out.append((xs.mean(), ys.mean()))
    return np.array(out)


def fill_ratio(frame: np.ndarray) -> float:
    """Shape pixels / bounding-box pixels of one frame: ~1 square, ~pi/4 circle, ~1/2 triangle."""
    ys, xs = np.nonzero(shape_mask(frame[None])[0])
    return len(xs) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
