"""The statistics ``mhla reproduce`` reports: a mean with its 95 % t interval over seeds, a paired comparison
of two arms over seeds (mean difference, its 95 % interval and the paired t test), Holm's correction within a
named family of comparisons, and the minimal detectable difference of a paired t test at 80 % power.

A difference is called (``established``) only where its Holm-corrected p is below :data:`ALPHA`; every other
comparison is reported as not established, beside the smallest true difference the design would have
detected with 80 % power (:func:`minimal_detectable_difference`)."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

__all__ = ["ALPHA", "POWER", "holm", "interval", "minimal_detectable_difference", "paired_difference"]

ALPHA = 0.05  # family-wise error rate of every named family (Holm)
POWER = 0.8  # the power at which the minimal detectable difference is given


def _t_quantile(df: int, level: float = 0.975) -> float:
    from scipy.stats import t

    return float(t.ppf(level, df))


def interval(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, standard deviation and the 95 % t interval of the mean over ``values`` (one per seed); the
    interval is ``None`` with fewer than two values."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return {"n": len(x), "mean": mean, "sd": None, "low": None, "high": None}
    sd = float(x.std(ddof=1))
    half = _t_quantile(len(x) - 1) * sd / math.sqrt(len(x))
    return {"n": len(x), "mean": mean, "sd": sd, "low": mean - half, "high": mean + half}


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int | list[float] | None]:
    """``a - b`` seed by seed: the mean difference, its standard error, its 95 % t interval (``low``,
    ``high``), the sample standard deviation of the differences (``sd``), the paired t statistic and its
    two-sided p-value (uncorrected: :func:`holm` corrects it within its family)."""
    a_values, b_values = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a_values.ndim != 1 or a_values.shape != b_values.shape:
        raise ValueError(
            f"paired_difference needs two equally long 1-D sequences, got shapes {a_values.shape} and {b_values.shape}"
        )
    d = a_values - b_values
    mean = float(d.mean())
    out: dict[str, float | int | list[float] | None] = {
        "n": len(d),
        "mean": mean,
        "sd": None,
        "se": None,
        "low": None,
        "high": None,
        "t": None,
        "p": None,
        "differences": d.tolist(),
    }
    if len(d) < 2:
        return out
    sd = float(d.std(ddof=1))
    se = sd / math.sqrt(len(d))
    half = _t_quantile(len(d) - 1) * se
    out |= {"sd": sd, "se": se, "low": mean - half, "high": mean + half}
    if se == 0.0:
        out["p"] = 1.0 if mean == 0.0 else 0.0  # every seed the same difference (no inf in JSON)
    else:
        from scipy.stats import t

        out["t"] = mean / se
        out["p"] = float(2 * t.sf(abs(mean / se), len(d) - 1))
    return out


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values of one family, in the input order (``None`` stays ``None`` and
    does not count towards the family size): sorted ascending, the ``i``-th smallest (from 0) of ``m`` becomes
    ``max_{j <= i} min(1, (m - j) p_(j))``. A comparison is called where its adjusted p is below the level;
    this controls the chance of any false call in the family at that level."""
    present = [(p, i) for i, p in enumerate(p_values) if p is not None]
    for p, _ in present:
        if not 0.0 <= p <= 1.0 or math.isnan(p):
            raise ValueError(f"holm: p-values must lie in [0, 1], got {p}")
    m = len(present)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(present)):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def _paired_t_power(effect: float, n: int, alpha: float) -> float:
    """Power of the two-sided one-sample t test at level ``alpha`` with ``n`` values, for a true mean of
    ``effect`` standard deviations: ``T = (Z + effect sqrt(n)) / sqrt(V / df)`` with ``V`` chi-square(df),
    integrated over ``V`` (the non-central t distribution, without scipy's ``nct``, which returns NaN at
    large df)."""
    from scipy.integrate import quad
    from scipy.stats import chi2, norm

    df = n - 1
    critical = _t_quantile(df, 1 - alpha / 2)
    shift = effect * math.sqrt(n)

    def rejected(v: float) -> float:
        edge = critical * math.sqrt(v / df)
        return float(chi2.pdf(v, df) * (norm.sf(edge - shift) + norm.cdf(-edge - shift)))

    low, high = chi2.ppf(1e-12, df), chi2.isf(1e-12, df)
    return float(quad(rejected, low, high, points=[df], limit=200, epsabs=1e-12)[0])


@functools.lru_cache(maxsize=None)
def _detectable_effect(n: int, alpha: float, power: float) -> float:
    """The smallest detectable true mean in standard deviations (the root is the same for every ``sd``, and
    slow at few seeds: about 1.7 s at two)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    # the normal approximation (z_(1-alpha/2) + z_power) / sqrt(n) is below the t test's root; grow it to bracket
    low = high = (norm.isf(alpha / 2) + norm.ppf(power)) / math.sqrt(n)
    while _paired_t_power(high, n, alpha) < power:
        low, high = high, 4 * high
    return float(brentq(lambda e: _paired_t_power(e, n, alpha) - power, low, high, xtol=1e-10 * high))


def minimal_detectable_difference(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference that a two-sided paired t test at level ``alpha`` over ``n`` seeds
    detects with probability ``power``, when the differences have standard deviation ``sd`` (exact, from the
    non-central t distribution; about ``(t_(1-alpha/2) + t_power) sd / sqrt(n)``)."""
    if n < 2:
        raise ValueError(f"minimal_detectable_difference needs at least two seeds, got {n}")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must lie in (0, 1), got {alpha} and {power}")
    if sd == 0.0:
        return 0.0
    effect = _detectable_effect(n, alpha, power)
    return float(effect * sd)
