"""Inception Score as the ADM evaluator computes it.

Softmax over all K = 1008 unbiased logits; consecutive splits of ``split_size`` (5000) samples, no
shuffling (the last split may be shorter); per split ``exp(mean_x KL(p(y|x) || p(y)))``; the score is
the mean over splits. Samples stored sorted by class give a much lower score (62 vs 298 for the same
50k ADM samples): keep them in random label order. :func:`inception_score_warnings` says when a
number is not comparable with ADM's (fewer samples than one split; samples grouped by class).
"""

from __future__ import annotations

import numpy as np
from scipy.special import log_softmax

__all__ = [
    "ADM_SPLIT_SIZE",
    "adjacent_label_agreement",
    "inception_score",
    "inception_score_splits",
    "inception_score_warnings",
]

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
        log_p = log_softmax(logits[start : start + split_size], axis=1)
        p = np.exp(log_p)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_p_y = np.log(p.mean(axis=0, keepdims=True))
            kl = np.where(p > 0, p * (log_p - log_p_y), 0.0).sum(axis=1)
        scores.append(np.exp(kl.mean()))
    return np.asarray(scores)


def inception_score(logits: np.ndarray, split_size: int = ADM_SPLIT_SIZE) -> float:
    """Mean of :func:`inception_score_splits` (ADM reports no standard deviation)."""
    return float(inception_score_splits(logits, split_size).mean())


def adjacent_label_agreement(labels: np.ndarray) -> tuple[float, float]:
    """``(observed, chance)``: the share of neighbouring samples with equal labels, and its expectation in
    random order (``sum_c p_c^2`` of the label frequencies; ``1 / num_classes`` for balanced classes)."""
    labels = np.asarray(labels).reshape(-1)
    if labels.size < 2:
        return 0.0, 0.0
    observed = float(np.mean(labels[1:] == labels[:-1]))
    _, counts = np.unique(labels, return_counts=True)
    chance = float(np.sum((counts / labels.size) ** 2))
    return observed, chance


def inception_score_warnings(
    count: int, labels: np.ndarray | None = None, split_size: int = ADM_SPLIT_SIZE
) -> list[str]:
    """Why an Inception Score over ``count`` samples (with class ``labels`` if known) is not comparable with
    ADM's numbers (10 splits of 5000): fewer samples than one split, or samples grouped by class (in any
    class order) across more than one split, where each split sees only some classes. Empty if neither.

    Grouping = the share of neighbouring samples with equal labels is more than halfway from its
    random-order value (:func:`adjacent_label_agreement`) to 1.
    """
    warnings = []
    if count < split_size:
        warnings.append(
            f"Inception Score over one split of {count} samples (fewer than the split size "
            f"{split_size}): not comparable with published numbers (ADM: 50,000 samples in 10 splits of "
            "5000); use at least one full split, 50,000 samples to compare with papers"
        )
    if labels is not None and count > split_size and len(np.unique(labels)) > 1:
        observed, chance = adjacent_label_agreement(labels)
        if observed > chance + 0.5 * (1 - chance):
            warnings.append(
                f"samples are grouped by class label ({observed:.0%} of neighbouring samples share a "
                f"label, {chance:.1%} expected in random order): each {split_size}-sample Inception Score split "
                "then sees only some classes and the score is far lower than for shuffled samples; "
                "shuffle them before packing"
            )
    return warnings
