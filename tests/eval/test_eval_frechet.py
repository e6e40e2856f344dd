"""Frechet distance and Gaussian statistics: closed forms, ADM's sqrtm form, streaming statistics."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from mhla_diffusion.eval.frechet import GaussianStats, RunningGaussian, frechet_distance, gaussian_stats, psd_sqrt


def random_covariance(d: int, rng: np.random.Generator, samples: int | None = None) -> np.ndarray:
    x = rng.normal(size=(samples or 3 * d, d)) * rng.uniform(0.2, 3.0, size=d)
    return np.cov(x, rowvar=False)


def adm_frechet_distance(s1: GaussianStats, s2: GaussianStats) -> float:
    """ADM evaluator's form: sqrtm of the non-symmetric product, real part of its trace."""
    covmean = scipy.linalg.sqrtm(s1.sigma @ s2.sigma)
    diff = s1.mu - s2.mu
    return float(diff @ diff + np.trace(s1.sigma) + np.trace(s2.sigma) - 2 * np.trace(covmean).real)


def test_identical_statistics_give_zero():
    rng = np.random.default_rng(0)
    stats = GaussianStats(rng.normal(size=32), random_covariance(32, rng))
    assert abs(frechet_distance(stats, stats)) < 1e-9 * np.trace(stats.sigma)


def test_diagonal_gaussians_closed_form():
    rng = np.random.default_rng(1)
    mu1, mu2 = rng.normal(size=8), rng.normal(size=8)
    a, b = rng.uniform(0.1, 4, size=8), rng.uniform(0.1, 4, size=8)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    got = frechet_distance(GaussianStats(mu1, np.diag(a)), GaussianStats(mu2, np.diag(b)))
    assert got == pytest.approx(expected, rel=1e-12)


def test_commuting_full_covariances_closed_form():
    """Same eigenvectors Q: FD = |dmu|^2 + sum (sqrt a_i - sqrt b_i)^2 even for non-diagonal matrices."""
    rng = np.random.default_rng(2)
    q, _ = np.linalg.qr(rng.normal(size=(12, 12)))
    a, b = rng.uniform(0.1, 5, size=12), rng.uniform(0.1, 5, size=12)
    s1, s2 = (q * a) @ q.T, (q * b) @ q.T
    expected = 1.0 + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    mu2 = np.zeros(12)
    mu2[3] = 1.0
    assert frechet_distance(GaussianStats(np.zeros(12), s1), GaussianStats(mu2, s2)) == pytest.approx(
        expected, rel=1e-10
    )


def test_matches_adm_sqrtm_form_and_is_symmetric():
    rng = np.random.default_rng(3)
    s1 = GaussianStats(rng.normal(size=64), random_covariance(64, rng))
    s2 = GaussianStats(rng.normal(size=64) + 0.5, random_covariance(64, rng))
    reference = adm_frechet_distance(s1, s2)
    assert frechet_distance(s1, s2) == pytest.approx(reference, rel=1e-9)
    assert frechet_distance(s2, s1) == pytest.approx(reference, rel=1e-9)


def test_singular_covariances_fewer_samples_than_dimensions():
    """N < D (rank-deficient sigma): still finite and equal to ADM's form."""
    rng = np.random.default_rng(4)
    s1 = gaussian_stats(rng.normal(size=(20, 48)))
    s2 = gaussian_stats(rng.normal(size=(20, 48)) * 1.5 + 0.2)
    assert frechet_distance(s1, s2) == pytest.approx(adm_frechet_distance(s1, s2), rel=1e-6)


def test_joint_permutation_invariance_one_sided_permutation_changes_the_value():
    """Why the sFID flatten order matters against stored statistics: only a joint permutation is harmless."""
    rng = np.random.default_rng(5)
    s1 = GaussianStats(rng.normal(size=16), random_covariance(16, rng))
    s2 = GaussianStats(rng.normal(size=16), random_covariance(16, rng))
    perm = rng.permutation(16)

    def permuted(s: GaussianStats) -> GaussianStats:
        return GaussianStats(s.mu[perm], s.sigma[np.ix_(perm, perm)])

    base = frechet_distance(s1, s2)
    assert frechet_distance(permuted(s1), permuted(s2)) == pytest.approx(base, rel=1e-10)
    assert abs(frechet_distance(permuted(s1), s2) - base) > 1e-3 * base


def test_psd_sqrt_squares_back():
    rng = np.random.default_rng(6)
    sigma = random_covariance(10, rng)
    root = psd_sqrt(sigma)
    np.testing.assert_allclose(root @ root, sigma, atol=1e-10)
    np.testing.assert_allclose(root, root.T, atol=1e-12)


def test_running_gaussian_matches_numpy_cov_across_batches():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(101, 9)) * rng.uniform(0.01, 2, size=9) + 1e4  # large offset: naive sums lose digits
    running = RunningGaussian()
    for start in (0, 7, 40, 41, 90):
        stop = {0: 7, 7: 40, 40: 41, 41: 90, 90: 101}[start]
        running.update(x[start:stop])
    stats = running.stats()
    assert stats.count == 101
    np.testing.assert_allclose(stats.mu, x.mean(0), rtol=1e-14)
    np.testing.assert_allclose(stats.sigma, np.cov(x, rowvar=False), rtol=1e-9, atol=1e-12)


def test_bad_statistics_are_rejected():
    with pytest.raises(ValueError, match="mu \\(D,\\) and sigma \\(D, D\\)"):
        GaussianStats(np.zeros(3), np.eye(4))
    with pytest.raises(ValueError, match="NaN or infinite"):
        GaussianStats(np.array([0.0, np.nan]), np.eye(2))
    with pytest.raises(ValueError, match="different feature layers"):
        frechet_distance(GaussianStats(np.zeros(3), np.eye(3)), GaussianStats(np.zeros(4), np.eye(4)))
    with pytest.raises(ValueError, match="at least 2"):
        RunningGaussian().stats()
    running = RunningGaussian()
    running.update(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="changed from 3 to 4"):
        running.update(np.zeros((2, 4)))
