"""ADM-style evaluation: sample images + a reference batch -> IS, FID, sFID, precision, recall.

The flow of ADM's ``evaluator.py``:

* samples: features of every image; FID/sFID statistics, IS logits, and pool features for P/R;
* reference: stored ``mu, sigma, mu_s, sigma_s`` when the ``.npz`` has them, else statistics of its
  images; pool features of its images (``arr_0``, 10,000 in ADM's files) for P/R.

Reference statistics can be computed once with :func:`make_reference` and saved in the same format.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from torchmetrics import Metric

from .features import FeatureExtractor
from .frechet import GaussianStats
from .images import ImageSource
from .inception_score import ADM_SPLIT_SIZE, inception_score_warnings
from .metrics import (
    ADM_BATCH_SIZE,
    ADMFrechetInceptionDistance,
    ADMInceptionScore,
    ADMPrecisionRecall,
    SpatialFID,
    source_features,
)
from .npz import AdmNpzWriter
from .precision_recall import ADM_K, DISTANCE_DTYPES
from .reference import Reference, check_reference_dims, load_reference

__all__ = ["Activations", "Reference", "compute_activations", "evaluate", "load_reference", "make_reference"]

logger = logging.getLogger(__name__)

ADM_PR_IMAGES = 10000


@dataclass
class Activations:
    """Features of one image set: Gaussian statistics for FID and sFID, and optionally the raw arrays."""

    count: int
    pool_stats: GaussianStats
    spatial_stats: GaussianStats
    pool: np.ndarray | None = None  # (N, D) float32
    logits: np.ndarray | None = None  # (N, K) float32


def _accumulate(
    source: ImageSource,
    extractor: FeatureExtractor,
    metrics: Sequence[Metric],
    real: bool,
    batch_size: int,
    progress: bool,
    desc: str | None,
    on_batch: Callable[[np.ndarray], None] | None = None,
) -> int:
    """Feed every batch's features (one forward) to ``metrics``; the number of images read."""
    count = 0
    for batch, features in source_features(source, extractor, batch_size, progress=progress, desc=desc):
        for metric in metrics:
            metric.update(features, real=real)
        count += len(batch)
        if on_batch is not None:
            on_batch(batch)
    if count < 2:
        raise ValueError(f"{source.name}: {count} image(s) read; statistics need at least 2")
    return count


def compute_activations(
    source: ImageSource,
    extractor: FeatureExtractor,
    batch_size: int = ADM_BATCH_SIZE,
    *,
    keep_pool: bool = True,
    keep_logits: bool = True,
    progress: bool = True,
    desc: str | None = None,
    on_batch: Callable[[np.ndarray], None] | None = None,
) -> Activations:
    """Run ``extractor`` over ``source`` in batches of ``batch_size`` (a progress bar over batches),
    accumulating through the metrics of :mod:`.metrics`.

    ``on_batch`` sees every uint8 batch ``(n, H, W, 3)`` after its features were taken.
    """
    fid = ADMFrechetInceptionDistance(extractor, sync_on_compute=False)
    sfid = SpatialFID(extractor, sync_on_compute=False)
    inception = ADMInceptionScore(extractor, sync_on_compute=False)
    pr = ADMPrecisionRecall(extractor, sync_on_compute=False)
    metrics = [fid, sfid] + ([inception] if keep_logits else []) + ([pr] if keep_pool else [])
    count = _accumulate(source, extractor, metrics, False, batch_size, progress, desc, on_batch)
    return Activations(
        count=count,
        pool_stats=fid.stats(),
        spatial_stats=sfid.stats(),
        pool=np.concatenate([x.cpu().numpy() for x in pr.fake_pool]) if keep_pool else None,
        logits=np.concatenate([x.cpu().numpy() for x in inception.logits]) if keep_logits else None,
    )


def evaluate(
    samples: ImageSource,
    reference: Reference,
    extractor: FeatureExtractor,
    *,
    batch_size: int = ADM_BATCH_SIZE,
    split_size: int = ADM_SPLIT_SIZE,
    k: int = ADM_K,
    with_precision_recall: bool = True,
    pr_block_size: int = 10000,
    pr_dtype: str = "float32",
    progress: bool = True,
    with_inception_score: bool = True,
) -> dict:
    """IS, FID, sFID and (if the reference has images) precision/recall of ``samples``.

    Returns a JSON-ready dict: ``metrics`` (``inception_score``, ``fid``, ``sfid``, ``precision``,
    ``recall``; None where not computed), ``samples``, ``reference``, ``settings``,
    ``feature_extractor`` (incl. the weights' SHA-256) and ``warnings``. ``pr_dtype``: precision/recall
    distances in ``"float32"`` (default) or ``"float16"`` (as ADM's evaluator; see :mod:`.precision_recall`).
    ``with_inception_score=False`` leaves the Inception Score out (and its warnings), for callers that do not
    report it (the embedded judges' FID / precision / recall).
    """
    if pr_dtype not in DISTANCE_DTYPES:
        raise ValueError(f"pr_dtype must be one of {', '.join(DISTANCE_DTYPES)}, got {pr_dtype!r}")
    check_reference_dims(reference, extractor)
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    pr = with_precision_recall and reference.images is not None
    if pr and min(len(samples), len(reference.images)) <= k:
        raise ValueError(
            f"precision/recall with k={k} need more than {k} images on each side, got "
            f"{len(samples)} samples and {len(reference.images)} reference images (or pass --no-pr)"
        )
    warnings: list[str] = []
    started = time.perf_counter()
    if with_precision_recall and reference.images is None:
        warnings.append("precision/recall skipped: the reference has no images (arr_0)")
    if with_inception_score:
        warnings.extend(inception_score_warnings(len(samples), samples.labels, split_size))

    quiet = {"sync_on_compute": False}  # one process's images, even inside a distributed run
    fid = ADMFrechetInceptionDistance(extractor, reference.stats.get("fid"), **quiet)
    sfid = SpatialFID(extractor, reference.stats.get("sfid"), **quiet)
    inception = ADMInceptionScore(extractor, split_size, **quiet) if with_inception_score else None
    pr_metric = ADMPrecisionRecall(extractor, k=k, block_size=pr_block_size, distance_dtype=pr_dtype, **quiet)
    extra = [pr_metric] if pr else []
    sample_metrics = [fid, sfid, *([inception] if inception is not None else []), *extra]
    gen_count = _accumulate(samples, extractor, sample_metrics, False, batch_size, progress, "samples")
    ref_count = None
    if reference.images is not None and (pr or len(reference.stats) < 2):
        ref_metrics = [m for m in (fid, sfid) if m.reference is None] + extra
        ref_count = _accumulate(reference.images, extractor, ref_metrics, True, batch_size, progress, "reference")

    metrics: dict[str, float | None] = {
        "inception_score": float(inception.compute()) if inception is not None else None,
        "fid": float(fid.compute()),
        "sfid": float(sfid.compute()),
        "precision": None,
        "recall": None,
    }
    if pr:
        metrics.update({name: float(value) for name, value in pr_metric.compute().items()})
    stored = sorted(reference.stats)
    for message in warnings:
        logger.warning(message)
    return {
        "metrics": metrics,
        "samples": {
            "source": samples.name,
            "count": gen_count,
            "image_size": list(samples.image_size),
            "skipped": list(samples.skipped),
        },
        "reference": {
            "source": reference.name,
            "statistics": "stored in the file"
            if len(stored) == 2
            else f"computed from {ref_count} images" + (f" (stored: {', '.join(stored)})" if stored else ""),
            "images": ref_count,
            "skipped": list(reference.images.skipped) if reference.images is not None else [],
        },
        "settings": {
            "batch_size": batch_size,
            "is_split_size": split_size,
            "pr_k": k,
            "precision_recall": pr,
            "pr_block_size": pr_block_size,
            "pr_dtype": pr_dtype,
        },
        "feature_extractor": extractor.info(),
        "warnings": warnings,
        "seconds": round(time.perf_counter() - started, 3),
    }


def make_reference(
    source: ImageSource,
    extractor: FeatureExtractor,
    output: str | os.PathLike,
    *,
    pr_images: int = ADM_PR_IMAGES,
    seed: int = 0,
    batch_size: int = ADM_BATCH_SIZE,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Write an ADM reference ``.npz``: ``mu, sigma, mu_s, sigma_s`` over all of ``source``, and as
    ``arr_0`` a seeded random subset of ``pr_images`` of its images (kept in source order) for P/R.

    The subset is held in memory until written (10,000 images of 256 x 256: 2 GB). Returns a summary.
    """
    output = Path(output)
    if output.suffix != ".npz":
        raise ValueError(f"{output}: the reference file must end in .npz")
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; choose another path or pass --overwrite")
    if pr_images < 0:
        raise ValueError(f"pr_images must be >= 0, got {pr_images}")
    count = len(source)
    keep = np.zeros(count, dtype=bool)
    keep[np.random.default_rng(seed).choice(count, size=min(pr_images, count), replace=False)] = True
    kept: list[np.ndarray] = []
    position = 0

    def collect(batch: np.ndarray) -> None:
        nonlocal position
        kept.append(batch[keep[position : position + len(batch)]])
        position += len(batch)

    activations = compute_activations(
        source,
        extractor,
        batch_size,
        keep_pool=False,
        keep_logits=False,
        progress=progress,
        desc="reference",
        on_batch=collect,
    )
    images = np.concatenate(kept) if kept else np.zeros((0, *source.image_size, 3), np.uint8)
    with AdmNpzWriter(output, overwrite=overwrite) as writer:
        if len(images):
            writer.begin_images(len(images), source.image_size)
            writer.write_images(images)
        writer.add_array("mu", activations.pool_stats.mu)
        writer.add_array("sigma", activations.pool_stats.sigma)
        writer.add_array("mu_s", activations.spatial_stats.mu)
        writer.add_array("sigma_s", activations.spatial_stats.sigma)
    return {
        "output": str(output),
        "images": activations.count,
        "arr_0": int(len(images)),
        "skipped": list(source.skipped),
        "feature_extractor": extractor.info(),
    }
