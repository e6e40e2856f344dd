"""Inception Score (closed forms, ADM's consecutive splits) and improved precision/recall on toy sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhla_diffusion.eval.inception_score import inception_score, inception_score_splits
from mhla_diffusion.eval.precision_recall import manifold_radii, precision_recall

CONFIDENT = 60.0  # logit gap: exp(-60) * 1008 is far below float64 resolution of the score


def one_hot_logits(labels: np.ndarray, num_logits: int = 1008) -> np.ndarray:
    logits = np.zeros((len(labels), num_logits))
    logits[np.arange(len(labels)), labels] = CONFIDENT
    return logits


def test_confident_predictions_spread_over_k_classes_score_k():
    labels = np.arange(40) % 8
    assert inception_score(one_hot_logits(labels), split_size=5000) == pytest.approx(8.0, rel=1e-9)


def test_single_class_and_uniform_predictions_score_one():
    assert inception_score(one_hot_logits(np.full(30, 5))) == pytest.approx(1.0, abs=1e-9)
    assert inception_score(np.zeros((30, 1008))) == pytest.approx(1.0, abs=1e-12)


def test_soft_two_class_closed_form():
    """p(y|x) = (q, 1-q) for half the samples, (1-q, q) for the rest: IS = exp(log 2 + q log q + (1-q) log(1-q))."""
    q = 0.8
    logit = np.log(q / (1 - q))
    logits = np.zeros((10, 2))
    logits[:5, 0] = logit
    logits[5:, 1] = logit
    expected = np.exp(np.log(2) + q * np.log(q) + (1 - q) * np.log(1 - q))
    assert inception_score(logits) == pytest.approx(expected, rel=1e-12)


def test_consecutive_splits_without_shuffling():
    """ADM splits in order: class-sorted samples give one class per split (IS 1), interleaved ones IS = K."""
    sorted_labels = np.repeat([0, 1], 6)
    np.testing.assert_allclose(
        inception_score_splits(one_hot_logits(sorted_labels), split_size=6), [1.0, 1.0], atol=1e-9
    )
    interleaved = np.tile([0, 1], 6)
    np.testing.assert_allclose(inception_score_splits(one_hot_logits(interleaved), split_size=6), [2.0, 2.0], rtol=1e-9)
    assert inception_score(one_hot_logits(sorted_labels), split_size=12) == pytest.approx(2.0, rel=1e-9)


def test_last_split_is_the_shorter_remainder():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(12, 7)) * 3
    scores = inception_score_splits(logits, split_size=5)
    assert scores.shape == (3,)
    for i, (start, stop) in enumerate([(0, 5), (5, 10), (10, 12)]):
        assert scores[i] == pytest.approx(inception_score_splits(logits[start:stop], split_size=100)[0], rel=1e-12)
    assert inception_score(logits, split_size=5) == pytest.approx(scores.mean())


def test_inception_score_rejects_bad_input():
    with pytest.raises(ValueError, match="split_size"):
        inception_score(np.zeros((4, 3)), split_size=0)
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        inception_score(np.zeros(5))


def test_radii_are_the_kth_neighbour_distance_squared():
    points = np.arange(5, dtype=np.float32)[:, None]  # 0, 1, 2, 3, 4 on a line
    np.testing.assert_array_equal(manifold_radii(points, k=3).numpy(), [9, 4, 4, 4, 9])
    np.testing.assert_array_equal(manifold_radii(points, k=1).numpy(), [1, 1, 1, 1, 1])


def test_identical_sets_have_full_precision_and_recall():
    x = np.random.default_rng(1).normal(size=(50, 6)).astype(np.float32)
    assert precision_recall(x, x.copy()) == (1.0, 1.0)


def test_far_apart_clusters_have_zero_precision_and_recall():
    rng = np.random.default_rng(2)
    ref = rng.normal(size=(30, 4)).astype(np.float32)
    samples = rng.normal(size=(40, 4)).astype(np.float32) + 100
    assert precision_recall(ref, samples) == (0.0, 0.0)


def test_mode_dropping_lowers_recall_only():
    """Reference = two far clusters; samples = exactly one of them: precision 1, recall 1/2."""
    rng = np.random.default_rng(3)
    cluster_a = rng.normal(size=(20, 5)).astype(np.float32)
    cluster_b = rng.normal(size=(20, 5)).astype(np.float32) + 50
    precision, recall = precision_recall(np.concatenate([cluster_a, cluster_b]), cluster_a.copy())
    assert (precision, recall) == (1.0, 0.5)


def test_a_point_exactly_on_a_radius_is_inside():
    ref = np.array([[0.0], [2.0]], dtype=np.float32)  # k = 1: both radii are 2^2 = 4
    on_edge = np.array([[4.0], [10.0]], dtype=np.float32)  # 4 is at squared distance 4 from 2
    assert precision_recall(ref, on_edge, k=1) == (0.5, 1.0)
    just_outside = np.array([[4.5], [10.0]], dtype=np.float32)
    assert precision_recall(ref, just_outside, k=1)[0] == 0.0


def test_blocking_does_not_change_the_result():
    rng = np.random.default_rng(4)
    ref = rng.normal(size=(37, 8)).astype(np.float32)
    samples = (rng.normal(size=(29, 8)) * 1.3 + 0.4).astype(np.float32)
    whole = precision_recall(ref, samples, block_size=1000)
    assert 0 < whole[0] < 1 and 0 < whole[1] < 1
    assert precision_recall(ref, samples, block_size=6) == whole
    assert precision_recall(torch.from_numpy(ref), torch.from_numpy(samples), block_size=5) == whole


def test_precision_recall_rejects_bad_input():
    with pytest.raises(ValueError, match="1 <= k < N"):
        precision_recall(np.zeros((3, 2)), np.zeros((10, 2)), k=3)
    with pytest.raises(ValueError, match="4-d but sample features 5-d"):
        precision_recall(np.zeros((10, 4)), np.zeros((10, 5)))
