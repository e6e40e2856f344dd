"""Inception Score as the ADM evaluator computes it.

Softmax over all K = 1008 unbiased logits; consecutive splits of ``split_size`` (5000) samples, no
shuffling (the last split may be shorter); per split ``exp(mean_x KL(p(y|x) || p(y)))``; the score is
the mean over splits. Samples stored sorted by class give a much lower score (62 vs 298 for the same
50k ADM samples): keep them in random label order.
"""

from __future__ import annotations

import numpy as np
from scipy.special import log_softmax

__all__ = ["ADM_SPLIT_SIZE", "inception_score", "inception_score_splits"]

ADM_SPLIT_SIZE = 5000


def inception_score_splits(logits: np.ndarray, split_size: int = ADM_SPLIT_SIZE) -> np.ndarray:
    """Per-split scores ``(ceil(N / split_size),)`` from logits ``(N, K)``, float64."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise ValueError(f"expected logits of shape (N, K) with N >= 1, got {logits.shape}")
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    scores = []
    for start in range(0, logits.shape[0], split_size):
        log_p = log_softmax(logits[start:start + split_size], axis=1)
        p = np.exp(log_p)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_p_y = np.log(p.mean(axis=0, keepdims=True))
            kl = np.where(p > 0, p * (log_p - log_p_y), 0.0).sum(axis=1)
        scores.append(np.exp(kl.mean()))
    return np.asarray(scores)


def inception_score(logits: np.ndarray, split_size: int = ADM_SPLIT_SIZE) -> float:
    """Mean of :func:`inception_score_splits` (ADM reports no standard deviation)."""
    return float(inception_score_splits(logits, split_size).mean())
