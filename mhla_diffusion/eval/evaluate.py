"""ADM-style evaluation: sample images + a reference batch -> IS, FID, sFID, precision, recall.

The flow of ADM's ``evaluator.py``:

* samples: features of every image; FID/sFID statistics, IS logits, and pool features for P/R;
* reference: stored ``mu, sigma, mu_s, sigma_s`` when the ``.npz`` has them, else statistics of its
  images; pool features of its images (``arr_0``, 10,000 in ADM's files) for P/R.

Reference statistics can be computed once with :func:`make_reference` and saved in the same format.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .features import FeatureExtractor, exact_float32, flatten_spatial
from .frechet import GaussianStats, RunningGaussian, frechet_distance
from .images import ImageSource, NpzImages, open_images
from .inception_score import ADM_SPLIT_SIZE, inception_score, inception_score_warnings
from .npz import AdmNpzWriter, npz_members, read_npz_stats
from .precision_recall import ADM_K, DISTANCE_DTYPES, precision_recall

__all__ = ["Activations", "Reference", "compute_activations", "evaluate", "load_reference", "make_reference"]

logger = logging.getLogger(__name__)

#: ADM's inference batch size for Inception.
ADM_BATCH_SIZE = 64
ADM_PR_IMAGES = 10000


@dataclass
class Activations:
    """Features of one image set: Gaussian statistics for FID and sFID, and optionally the raw arrays."""

    count: int
    pool_stats: GaussianStats
    spatial_stats: GaussianStats
    pool: np.ndarray | None = None  # (N, D) float32
    logits: np.ndarray | None = None  # (N, K) float32


@dataclass
class Reference:
    """A reference batch: its images (for P/R, or statistics when none are stored) and stored statistics."""

    name: str
    images: ImageSource | None
    stats: dict[str, GaussianStats] = field(default_factory=dict)  # "fid" and/or "sfid"


def compute_activations(source: ImageSource, extractor: FeatureExtractor, batch_size: int = ADM_BATCH_SIZE, *,
                        keep_pool: bool = True, keep_logits: bool = True, progress: bool = True,
                        desc: str | None = None, on_batch: Callable[[np.ndarray], None] | None = None) -> Activations:
    """Run ``extractor`` over ``source`` in batches of ``batch_size`` (a progress bar over batches).

    ``on_batch`` sees every uint8 batch ``(n, H, W, 3)`` after its features were taken.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pool_stats, spatial_stats = RunningGaussian(), RunningGaussian()
    pools, logits = [], []
    batches = source.iter_batches(batch_size)
    total = math.ceil(len(source) / batch_size)
    with torch.inference_mode(), exact_float32():
        for batch in tqdm(batches, total=total, desc=desc or source.name, unit="batch", disable=not progress):
            features = extractor(torch.tensor(batch).permute(0, 3, 1, 2).contiguous())
            pool = features["pool"].double().cpu().numpy()
            spatial = flatten_spatial(features["spatial"]).double().cpu().numpy()
            if pool.shape[1] != extractor.pool_dim or spatial.shape[1] != extractor.spatial_dim:
                raise ValueError(f"{type(extractor).__name__} returned {pool.shape[1]}-d pool / {spatial.shape[1]}-d "
                                 f"spatial features, declared {extractor.pool_dim} / {extractor.spatial_dim}")
            pool_stats.update(pool)
            spatial_stats.update(spatial)
            if keep_pool:
                pools.append(features["pool"].float().cpu().numpy())
            if keep_logits:
                logits.append(features["logits_unbiased"].float().cpu().numpy())
            if on_batch is not None:
                on_batch(batch)
    if pool_stats.count < 2:
        raise ValueError(f"{source.name}: {pool_stats.count} image(s) read; statistics need at least 2")
    return Activations(
        count=pool_stats.count,
        pool_stats=pool_stats.stats(),
        spatial_stats=spatial_stats.stats(),
        pool=np.concatenate(pools) if keep_pool else None,
        logits=np.concatenate(logits) if keep_logits else None,
    )


def load_reference(path: str | os.PathLike, skip_corrupt: bool = False, workers: int = 4) -> Reference:
    """A reference from an ADM ``.npz`` (stored statistics and/or ``arr_0``) or a folder of images."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"reference {path} does not exist")
    if path.is_dir():
        return Reference(str(path), open_images(path, skip_corrupt=skip_corrupt, workers=workers))
    if path.suffix != ".npz":
        raise ValueError(f"reference {path}: expected an ADM .npz or a folder of images")
    stats = read_npz_stats(path)
    images = NpzImages(path) if "arr_0" in npz_members(path) else None
    if images is None and len(stats) < 2:
        raise ValueError(f"reference {path} has neither images (arr_0) nor both mu/sigma and mu_s/sigma_s")
    return Reference(str(path), images, stats)


def _check_dims(reference: Reference, extractor: FeatureExtractor) -> None:
    expected = {"fid": extractor.pool_dim, "sfid": extractor.spatial_dim}
    for metric, stats in reference.stats.items():
        if stats.dim != expected[metric]:
            raise ValueError(f"reference {reference.name}: stored {metric} statistics are {stats.dim}-d but the feature "
                             f"network gives {expected[metric]}-d features; they were computed with another network")


def evaluate(samples: ImageSource, reference: Reference, extractor: FeatureExtractor, *,
             batch_size: int = ADM_BATCH_SIZE, split_size: int = ADM_SPLIT_SIZE, k: int = ADM_K,
             with_precision_recall: bool = True, pr_block_size: int = 10000, pr_dtype: str = "float32",
             progress: bool = True) -> dict:
    """IS, FID, sFID and (if the reference has images) precision/recall of ``samples``.

    Returns a JSON-ready dict: ``metrics`` (``inception_score``, ``fid``, ``sfid``, ``precision``,
    ``recall``; None where not computed), ``samples``, ``reference``, ``settings``,
    ``feature_extractor`` (incl. the weights' SHA-256) and ``warnings``. ``pr_dtype``: precision/recall
    distances in ``"float32"`` (default) or ``"float16"`` (as ADM's evaluator; see :mod:`.precision_recall`).
    """
    if pr_dtype not in DISTANCE_DTYPES:
        raise ValueError(f"pr_dtype must be one of {', '.join(DISTANCE_DTYPES)}, got {pr_dtype!r}")
    _check_dims(reference, extractor)
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    pr = with_precision_recall and reference.images is not None
    if pr and min(len(samples), len(reference.images)) <= k:
        raise ValueError(f"precision/recall with k={k} need more than {k} images on each side, got "
                         f"{len(samples)} samples and {len(reference.images)} reference images (or pass --no-pr)")
    warnings: list[str] = []
    started = time.perf_counter()
    if with_precision_recall and reference.images is None:
        warnings.append("precision/recall skipped: the reference has no images (arr_0)")
    warnings.extend(inception_score_warnings(len(samples), samples.labels, split_size))

    gen = compute_activations(samples, extractor, batch_size, keep_pool=pr, progress=progress, desc="samples")
    ref_stats = dict(reference.stats)
    ref_pool, ref_count = None, None
    if reference.images is not None and (pr or len(ref_stats) < 2):
        ref = compute_activations(reference.images, extractor, batch_size, keep_pool=pr, keep_logits=False,
                                  progress=progress, desc="reference")
        ref_stats.setdefault("fid", ref.pool_stats)
        ref_stats.setdefault("sfid", ref.spatial_stats)
        ref_pool, ref_count = ref.pool, ref.count

    metrics: dict[str, float | None] = {
        "inception_score": inception_score(gen.logits, split_size),
        "fid": frechet_distance(gen.pool_stats, ref_stats["fid"]),
        "sfid": frechet_distance(gen.spatial_stats, ref_stats["sfid"]),
        "precision": None,
        "recall": None,
    }
    if pr:
        with exact_float32():
            metrics["precision"], metrics["recall"] = precision_recall(
                ref_pool, gen.pool, k=k, block_size=pr_block_size, device=extractor.device, distance_dtype=pr_dtype)
    stored = sorted(reference.stats)
    for message in warnings:
        logger.warning(message)
    return {
        "metrics": metrics,
        "samples": {"source": samples.name, "count": gen.count, "image_size": list(samples.image_size),
                    "skipped": list(samples.skipped)},
        "reference": {
            "source": reference.name,
            "statistics": "stored in the file" if len(stored) == 2 else f"computed from {ref_count} images"
            + (f" (stored: {', '.join(stored)})" if stored else ""),
            "images": ref_count,
            "skipped": list(reference.images.skipped) if reference.images is not None else [],
        },
        "settings": {"batch_size": batch_size, "is_split_size": split_size, "pr_k": k,
                     "precision_recall": pr, "pr_block_size": pr_block_size, "pr_dtype": pr_dtype},
        "feature_extractor": extractor.info(),
        "warnings": warnings,
        "seconds": round(time.perf_counter() - started, 3),
    }


def make_reference(source: ImageSource, extractor: FeatureExtractor, output: str | os.PathLike, *,
                   pr_images: int = ADM_PR_IMAGES, seed: int = 0, batch_size: int = ADM_BATCH_SIZE,
                   overwrite: bool = False, progress: bool = True) -> dict:
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
        kept.append(batch[keep[position:position + len(batch)]])
        position += len(batch)

    activations = compute_activations(source, extractor, batch_size, keep_pool=False, keep_logits=False,
                                      progress=progress, desc="reference", on_batch=collect)
    images = np.concatenate(kept) if kept else np.zeros((0, *source.image_size, 3), np.uint8)
    with AdmNpzWriter(output, overwrite=overwrite) as writer:
        if len(images):
            writer.begin_images(len(images), source.image_size)
            writer.write_images(images)
        writer.add_array("mu", activations.pool_stats.mu)
        writer.add_array("sigma", activations.pool_stats.sigma)
        writer.add_array("mu_s", activations.spatial_stats.mu)
        writer.add_array("sigma_s", activations.spatial_stats.sigma)
    return {"output": str(output), "images": activations.count, "arr_0": int(len(images)),
            "skipped": list(source.skipped), "feature_extractor": extractor.info()}
