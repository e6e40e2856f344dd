"""FID / sFID during fine-tuning: ``validation_fid_samples`` samples of the training model against a
reference ``.npz`` (ADM format with stored ``mu, sigma, mu_s, sigma_s``), every
``validation_fid_steps`` optimizer steps and at the end, logged as ``validation/fid`` and
``validation/sfid`` beside the loss.

Every process samples its share (sample ``i`` belongs to process ``i % num_processes``, seeded by
``(validation_seed, i)`` as ``mhla eval-sample`` does) and runs the FID Inception network on its own
images into the torchmetrics :class:`~mhla_diffusion.eval.metrics.ADMFrechetInceptionDistance` /
:class:`~mhla_diffusion.eval.metrics.SpatialFID`, whose float64 feature sums are reduced across the
processes on ``compute()`` (the same numbers as one process over all the images). DiT: class labels
i.i.d. uniform over the model's classes; Wan: the validation prompts cycled, and
**every frame of every clip is one image** (per-frame FID, so
``N`` clips of ``F`` frames give ``N * F`` images; the reference should hold frames or images of the
same kind).

The definitions are those of ``mhla eval`` (pool_3 and mixed_6/conv features, Frechet distance of
float64 statistics).

The weights come from ``inception_weights`` or ``$MHLA_INCEPTION_WEIGHTS``; with neither set, validation
FID is skipped with a one-line message; a path that is set but missing is an error. Under FSDP (the
local model holds shards) validation FID is skipped with a warning, as the validation samples are.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["ValidationFID", "prepare_validation_fid"]

logger = logging.getLogger(__name__)

#: ``(unwrapped model, sample indices) -> uint8 images (n, H, W, 3)`` (Wan: every frame of every clip).
FIDSampler = Callable[[torch.nn.Module, Sequence[int]], np.ndarray]


def _check_reference(path: str) -> dict:
    """The reference's stored statistics, or an error saying what is wrong with the file."""
    from ..eval.inception import InceptionV3Features
    from ..eval.npz import npz_members, read_npz_stats

    reference = Path(path).expanduser()
    if not reference.is_file():
        raise FileNotFoundError(
            f"validation_fid_reference {reference} does not exist or is not a file "
            "(make one with `mhla eval-ref IMAGES OUT.npz`)"
        )
    if reference.suffix != ".npz":
        raise ValueError(f"validation_fid_reference {reference}: expected an ADM .npz with mu, sigma, mu_s, sigma_s")
    try:
        members = npz_members(reference)
        stats = read_npz_stats(reference)
    except Exception as error:  # not a zip, unreadable arrays
        raise ValueError(f"validation_fid_reference {reference} is not a readable ADM .npz: {error}") from None
    missing = [k for k in ("mu", "sigma", "mu_s", "sigma_s") if k not in members]
    if missing or len(stats) < 2:
        raise ValueError(
            f"validation_fid_reference {reference} lacks {', '.join(missing) or 'statistics'}: validation "
            "FID needs stored statistics (mu, sigma, mu_s, sigma_s); make them with `mhla eval-ref`"
        )
    expected = {"fid": InceptionV3Features.pool_dim, "sfid": int(np.prod(InceptionV3Features.spatial_shape))}
    for metric, value in stats.items():
        if value.dim != expected[metric]:
            raise ValueError(
                f"validation_fid_reference {reference}: stored {metric} statistics are {value.dim}-d, the "
                f"FID Inception network gives {expected[metric]}-d features (another network's file?)"
            )
    return stats


def prepare_validation_fid(options) -> "ValidationFID | None":
    """Check the validation-FID options before any work: ``None`` when not requested, or skipped (no
    Inception weights configured: one logged line); errors for a bad reference or a missing weights file."""
    from ..eval.inception_weights import INCEPTION_WEIGHTS_ENV, resolve_inception_weights

    if not options.validation_fid_reference:
        return None
    stats = _check_reference(options.validation_fid_reference)
    if not options.inception_weights and not os.environ.get(INCEPTION_WEIGHTS_ENV):
        if os.environ.get("RANK", "0") == "0":  # once per run (the Accelerator does not exist yet)
            logger.warning(
                "validation FID skipped: no Inception weights (set `inception_weights` or $%s to the FID "
                "Inception-v3 weights file, see docs/evaluate.md)",
                INCEPTION_WEIGHTS_ENV,
            )
        return None
    weights = resolve_inception_weights(options.inception_weights or None)  # set but missing: an error
    return ValidationFID(stats, weights, options.validation_fid_samples, options.validation_fid_steps)


class ValidationFID:
    """Reference statistics, the Inception network (loaded once, on CPU until first used) and the
    torchmetrics FID / sFID metrics of :mod:`mhla_diffusion.eval.metrics` around it."""

    def __init__(self, reference_stats: dict, weights: Path, num_samples: int, every: int) -> None:
        from ..eval.inception import InceptionV3Features
        from ..eval.metrics import ADMFrechetInceptionDistance, SpatialFID

        self.num_samples = num_samples
        self.every = every
        self.extractor = InceptionV3Features(weights)  # a file that is not the network fails here, before training
        self.fid = ADMFrechetInceptionDistance(self.extractor, reference_stats["fid"])
        self.sfid = SpatialFID(self.extractor, reference_stats["sfid"])

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def run(self, accelerator, sampler: FIDSampler, model: torch.nn.Module) -> dict[str, float]:
        """Sample this process's share, add its features to the metrics, and compute them across all
        processes (the metrics' sums are reduced by torchmetrics): ``{validation/fid, validation/sfid}``."""
        from ..eval.metrics import extract_features
        from ..eval.sample import shard_indices

        device = accelerator.device
        self.fid.to(device)
        self.sfid.to(device)
        self.fid.reset()
        self.sfid.reset()
        indices = list(shard_indices(self.num_samples, accelerator.process_index, accelerator.num_processes))
        if indices:
            with torch.no_grad(), accelerator.autocast():
                images = np.asarray(sampler(model, indices))
            for start in range(0, len(images), 64):  # ADM's Inception batch size
                features = extract_features(self.extractor, images[start : start + 64])
                self.fid.update(features)
                self.sfid.update(features)
        values = {
            "validation/fid": _finite(float(self.fid.compute())),  # collective: every process calls it
            "validation/sfid": _finite(float(self.sfid.compute())),
        }
        self.fid.reset()
        self.sfid.reset()
        return values


def _finite(value: float) -> float:
    return value if math.isfinite(value) else float("nan")
