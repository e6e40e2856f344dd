"""Gaussian feature statistics and the Frechet distance (FID, sFID), in float64.

    FD = ||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr sqrt(S1 S2)

``tr sqrt(S1 S2)`` is computed in the symmetric form ``tr sqrt(S1^1/2 S2 S1^1/2)`` with two
symmetric eigendecompositions (negative round-off eigenvalues clipped to 0). For covariance
matrices this equals ADM's ``scipy.linalg.sqrtm(S1 @ S2)`` trace, without sqrtm's failure modes
(complex results, scipy 1.11 regressions, the deprecated ``disp`` argument).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GaussianStats", "RunningGaussian", "frechet_distance", "gaussian_from_sums", "gaussian_stats", "psd_sqrt"]


@dataclass(frozen=True)
class GaussianStats:
    """Mean ``mu`` ``(D,)`` and unbiased covariance ``sigma`` ``(D, D)`` of features, float64."""

    mu: np.ndarray
    sigma: np.ndarray
    count: int | None = None

    def __post_init__(self) -> None:
        mu = np.asarray(self.mu, dtype=np.float64)
        sigma = np.asarray(self.sigma, dtype=np.float64)
        if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
            raise ValueError(f"statistics need mu (D,) and sigma (D, D); got {mu.shape} and {sigma.shape}")
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
            raise ValueError("statistics contain NaN or infinite values")
        object.__setattr__(self, "mu", mu)
        object.__setattr__(self, "sigma", sigma)

    @property
    def dim(self) -> int:
        return self.mu.shape[0]


def gaussian_stats(features: np.ndarray) -> GaussianStats:
    """``(N, D)`` features -> mean and unbiased covariance (``np.cov``, N - 1), float64."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"need at least 2 feature vectors (N, D) for a covariance, got shape {features.shape}")
    return GaussianStats(features.mean(axis=0), np.cov(features, rowvar=False), count=features.shape[0])


def gaussian_from_sums(
    count: int, total: np.ndarray, outer: np.ndarray, shift: np.ndarray | None = None
) -> GaussianStats:
    """Mean and unbiased covariance from ``count`` vectors' float64 ``total = sum(x - shift)`` ``(D,)`` and
    ``outer = sum((x - shift)(x - shift)^T)`` ``(D, D)`` (``shift`` 0 when None). The one formula of the
    accumulated statistics (:class:`RunningGaussian`, the torchmetrics metrics of :mod:`.metrics`)."""
    count = int(count)
    if count < 2:
        raise ValueError(f"need at least 2 feature vectors for a covariance, got {count}")
    total = np.asarray(total, dtype=np.float64)
    outer = np.asarray(outer, dtype=np.float64)
    mean = total / count
    sigma = (outer - count * np.outer(mean, mean)) / (count - 1)
    return GaussianStats(mean if shift is None else shift + mean, (sigma + sigma.T) / 2, count=count)


class RunningGaussian:
    """Mean and unbiased covariance accumulated batch by batch, float64, O(D^2) memory.

    Sums are taken around the first batch's mean (the covariance does not depend on the shift), so
    features far from 0 lose no precision in ``X^T X``.
    """

    def __init__(self) -> None:
        self.count = 0
        self._shift: np.ndarray | None = None
        self._sum: np.ndarray | None = None
        self._outer: np.ndarray | None = None

    def update(self, features: np.ndarray) -> None:
        """Add a batch ``(n, D)``."""
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2:
            raise ValueError(f"expected features of shape (n, D), got {x.shape}")
        if x.shape[0] == 0:
            return
        if self._shift is None:
            self._shift = x.mean(axis=0)
            self._sum = np.zeros_like(self._shift)
            self._outer = np.zeros((x.shape[1], x.shape[1]))
        elif x.shape[1] != self._shift.shape[0]:
            raise ValueError(f"feature size changed from {self._shift.shape[0]} to {x.shape[1]}")
        x = x - self._shift
        self._sum += x.sum(axis=0)
        self._outer += x.T @ x
        self.count += x.shape[0]

    def stats(self) -> GaussianStats:
        """The statistics so far (needs at least 2 vectors)."""
        if self.count < 2:
            raise ValueError(f"need at least 2 feature vectors for a covariance, got {self.count}")
        return gaussian_from_sums(self.count, self._sum, self._outer, self._shift)


def psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric positive semi-definite matrix (negative eigenvalues -> 0)."""
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def frechet_distance(stats1: GaussianStats, stats2: GaussianStats) -> float:
    """Frechet distance between two Gaussians (symmetric in its arguments)."""
    if stats1.dim != stats2.dim:
        raise ValueError(
            f"cannot compare {stats1.dim}-d with {stats2.dim}-d statistics: "
            "they come from different feature layers or networks"
        )
    diff = stats1.mu - stats2.mu
    root1 = psd_sqrt(stats1.sigma)
    middle = root1 @ stats2.sigma @ root1
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    return float(diff @ diff + np.trace(stats1.sigma) + np.trace(stats2.sigma) - 2 * tr_covmean)
