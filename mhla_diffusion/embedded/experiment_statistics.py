"""The statistics ``mhla reproduce`` reports: a mean with its 95 % t interval over seeds, and a paired
comparison of two arms over seeds that calls a difference only beyond two standard errors."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["interval", "paired_difference"]

CALL_STANDARD_ERRORS = 2.0


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


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int | bool | None]:
    """``a - b`` seed by seed: the mean difference, its standard error, the paired t statistic, its
    two-sided p-value and ``called`` (the mean lies more than two standard errors from zero)."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    mean = float(d.mean())
    if len(d) < 2:
        return {"n": len(d), "mean": mean, "se": None, "t": None, "p": None, "called": False, "differences": d.tolist()}
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    if se == 0.0:
        t_stat, p = None, (1.0 if mean == 0.0 else 0.0)  # every seed the same difference (no inf in JSON)
    else:
        from scipy.stats import t

        t_stat = mean / se
        p: float = float(2 * t.sf(abs(t_stat), len(d) - 1))
    return {
        "n": len(d),
        "mean": mean,
        "se": se,
        "t": t_stat,
        "p": p,
        "called": bool(abs(mean) > CALL_STANDARD_ERRORS * se),
        "differences": d.tolist(),
    }
