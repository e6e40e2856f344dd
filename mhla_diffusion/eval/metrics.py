"""torchmetrics metrics with ADM's definitions: FID, sFID, Inception Score, precision/recall.

Each metric is a :class:`torchmetrics.Metric` around a feature network (the
:class:`~mhla_diffusion.eval.features.FeatureExtractor` interface: ``InceptionV3Features(path)`` for
comparable numbers; any other ``nn.Module`` returning ``(N, D)`` features, as torchmetrics' ``feature=``,
is wrapped by :class:`~.features.TensorFeatures`). ``update(images, real=False)`` takes uint8 images
``(N, H, W, 3)`` (ADM's layout) or ``(N, 3, H, W)`` -- a tensor or an array; ``(N, 3, H, 3)`` is read as
NHWC -- or the feature dict
:func:`extract_features` returned for them (one forward shared by several metrics). ``compute()``
gives the numbers ``mhla eval`` / :func:`~mhla_diffusion.eval.evaluate.evaluate` report: ``evaluate``
accumulates through these classes.

Metrics given the same feature network share its features: an ``update`` with the batch the network
saw last (same pixels, same weights) reuses that forward, so a torchmetrics ``MetricCollection`` of
FID, sFID, IS and P/R runs the network once per update. The last batch and its features are kept
until the next batch (or the network) goes.

The reference side is either given at construction (``reference=``: a :class:`~.reference.Reference`
from :func:`~.reference.load_reference`, the path of an ADM ``.npz`` or image folder, or for FID/sFID a
:class:`~.frechet.GaussianStats`, for P/R an ``(N, D)`` array of pool features) and stays across
``reset()``, or accumulated with ``update(images, real=True)`` as in torchmetrics' FID.

Distributed (DDP) use: states sync on ``compute()`` like any torchmetrics metric (with NCCL, move the
metric to the process's GPU, ``metric.to(device)``; that moves the feature network too).

* FID / sFID keep float64 sums (count, sum of features, sum of outer products; reduced by sum), so the
  result equals one process over the union of the images (to float64 round-off of the sums' order).
  Sums are taken about 0: Inception features are O(1), float64 keeps far more digits than FID shows.
* The Inception Score keeps the logits (reduced by concatenation). Its 5000-sample splits are taken
  in the gathered order: process 0's samples, then process 1's, ...; with several processes the score
  equals one process over the images in that order, not in the order they were generated.
* Precision / recall keep the pool features (reduced by concatenation).
"""

from __future__ import annotations

import os
import weakref
from typing import Iterator, Mapping

import numpy as np
import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat
from tqdm.auto import tqdm

from ..utils.tensor_versions import write_count
from .features import FeatureExtractor, TensorFeatures, as_feature_extractor, exact_float32, flatten_spatial
from .frechet import GaussianStats, frechet_distance, gaussian_from_sums
from .images import ImageSource
from .inception_score import ADM_SPLIT_SIZE, inception_score
from .precision_recall import ADM_K, DISTANCE_DTYPES, precision_recall
from .reference import Reference, load_reference

__all__ = [
    "ADMFrechetInceptionDistance",
    "ADMInceptionScore",
    "ADMPrecisionRecall",
    "SpatialFID",
    "extract_features",
    "source_features",
]

#: ADM's inference batch size for Inception.
ADM_BATCH_SIZE = 64


def _as_nchw_uint8(images: torch.Tensor | np.ndarray) -> torch.Tensor:
    x = images if torch.is_tensor(images) else torch.tensor(np.asarray(images))
    if x.dtype != torch.uint8:
        raise ValueError(f"images must be uint8 with values 0..255, got {x.dtype}")
    if x.dim() != 4 or 3 not in (x.shape[1], x.shape[3]):
        raise ValueError(f"images must be RGB (N, H, W, 3) or (N, 3, H, W), got {tuple(x.shape)}")
    return x.permute(0, 3, 1, 2).contiguous() if x.shape[3] == 3 else x


def extract_features(extractor: FeatureExtractor, images: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
    """Run ``extractor`` on uint8 images (NHWC or NCHW), TF32 off: ``{"pool": (N, D), "spatial": (N, h*w*c)
    flattened in ADM's order, "logits_unbiased": (N, K)}``, float32, on the extractor's device."""
    with torch.inference_mode(), exact_float32():
        features = extractor(_as_nchw_uint8(images))
    pool, spatial = features["pool"].float(), flatten_spatial(features["spatial"]).float()
    if pool.shape[1] != extractor.pool_dim or spatial.shape[1] != extractor.spatial_dim:
        raise ValueError(
            f"{type(extractor).__name__} returned {pool.shape[1]}-d pool / {spatial.shape[1]}-d "
            f"spatial features, declared {extractor.pool_dim} / {extractor.spatial_dim}"
        )
    return {"pool": pool, "spatial": spatial, "logits_unbiased": features["logits_unbiased"].float()}


#: Per feature network: the last batch it saw, its weights' versions, and that batch's features.
_LAST_FEATURES: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _weights_versions(network: nn.Module) -> tuple[int, ...]:
    """Version counters of the weights (bumped by any in-place change, e.g. ``load_state_dict``;
    :func:`~mhla_diffusion.utils.tensor_versions.write_count`); inference-mode tensors keep none (-1); ``None`` where
    PyTorch cannot tell (then the features are never reused)."""
    return tuple(-1 if p.is_inference() else write_count(p) for p in network.parameters())


def shared_features(extractor: FeatureExtractor, images: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
    """:func:`extract_features`, reusing the last forward of the same network on an equal batch."""
    network = extractor.module if isinstance(extractor, TensorFeatures) else extractor
    x = _as_nchw_uint8(images)
    versions = _weights_versions(network)
    last = _LAST_FEATURES.get(network)
    if (
        last is not None
        and None not in versions
        and last[1] == versions
        and last[0].shape == x.shape
        and last[0].device == x.device
        and torch.equal(last[0], x)
    ):
        return last[2]
    features = extract_features(extractor, x)
    _LAST_FEATURES[network] = (x.clone(), versions, features)
    return features


def source_features(
    source: ImageSource,
    extractor: FeatureExtractor,
    batch_size: int = ADM_BATCH_SIZE,
    *,
    progress: bool = False,
    desc: str | None = None,
) -> Iterator[tuple[np.ndarray, dict]]:
    """``(uint8 batch (n, H, W, 3), its features)`` for ``source`` in batches (a progress bar over batches)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total = -(-len(source) // batch_size)
    for batch in tqdm(
        source.iter_batches(batch_size), total=total, desc=desc or source.name, unit="batch", disable=not progress
    ):
        yield batch, extract_features(extractor, batch)


def _resolve_reference(reference) -> object:
    return load_reference(reference) if isinstance(reference, (str, os.PathLike)) else reference


class _ADMMetric(Metric):
    """Holds the feature network; ``update`` takes images or their features."""

    full_state_update = False
    is_differentiable = False

    def __init__(self, extractor: FeatureExtractor | nn.Module, batch_size: int = ADM_BATCH_SIZE, **kwargs) -> None:
        super().__init__(**kwargs)
        self.extractor = as_feature_extractor(extractor)
        self.batch_size = batch_size

    def _features(self, images) -> Mapping[str, torch.Tensor]:
        return images if isinstance(images, Mapping) else shared_features(self.extractor, images)

    def _reference_features(self, source: ImageSource) -> Iterator[dict]:
        for _, features in source_features(source, self.extractor, self.batch_size):
            yield features


class _FrechetMetric(_ADMMetric):
    higher_is_better = False
    _feature = "pool"
    _stats_key = "fid"

    def __init__(
        self,
        extractor: FeatureExtractor | nn.Module,
        reference: Reference | GaussianStats | str | os.PathLike | None = None,
        **kwargs,
    ) -> None:
        super().__init__(extractor, **kwargs)
        dim = self.extractor.pool_dim if self._feature == "pool" else self.extractor.spatial_dim
        for side in ("real", "fake"):
            self.add_state(f"{side}_count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
            self.add_state(f"{side}_sum", torch.zeros(dim, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"{side}_outer", torch.zeros(dim, dim, dtype=torch.float64), dist_reduce_fx="sum")
        self.reference = self._reference_stats(_resolve_reference(reference), dim)

    def _reference_stats(self, reference, dim: int) -> GaussianStats | None:
        if reference is None or isinstance(reference, GaussianStats):
            stats = reference
        elif isinstance(reference, Reference):
            stats = reference.stats.get(self._stats_key)
            if stats is None:
                if reference.images is None:
                    raise ValueError(f"reference {reference.name} has neither {self._stats_key} statistics nor images")
                total = torch.zeros(dim, dtype=torch.float64)
                outer = torch.zeros(dim, dim, dtype=torch.float64)
                count = 0
                for features in self._reference_features(reference.images):
                    x = features[self._feature].double().cpu()
                    total += x.sum(0)
                    outer += x.T @ x
                    count += x.shape[0]
                stats = gaussian_from_sums(count, total.numpy(), outer.numpy())
        else:
            raise TypeError(f"reference must be a Reference, GaussianStats or a path, got {type(reference).__name__}")
        if stats is not None and stats.dim != dim:
            raise ValueError(
                f"reference {self._stats_key} statistics are {stats.dim}-d but the feature network gives "
                f"{dim}-d features; they were computed with another network"
            )
        return stats

    def update(self, images, real: bool = False) -> None:
        """Add uint8 images (or their features) to the samples, or with ``real=True`` to the reference."""
        if real and self.reference is not None:
            raise ValueError(f"{type(self).__name__} was given reference statistics; real images cannot be added")
        x = self._features(images)[self._feature]
        x = x.reshape(x.shape[0], -1).to(device=self.fake_sum.device, dtype=torch.float64)
        side = "real" if real else "fake"
        setattr(self, f"{side}_count", getattr(self, f"{side}_count") + x.shape[0])
        setattr(self, f"{side}_sum", getattr(self, f"{side}_sum") + x.sum(0))
        setattr(self, f"{side}_outer", getattr(self, f"{side}_outer") + x.T @ x)

    def stats(self, real: bool = False) -> GaussianStats:
        """Mean and unbiased covariance of the states as they stand (on this process unless inside ``compute``)."""
        side = "real" if real else "fake"
        return gaussian_from_sums(
            int(getattr(self, f"{side}_count")),
            getattr(self, f"{side}_sum").cpu().numpy(),
            getattr(self, f"{side}_outer").cpu().numpy(),
        )

    def compute(self) -> torch.Tensor:
        """The Frechet distance of the samples to the reference (float64 scalar)."""
        reference = self.reference if self.reference is not None else self.stats(real=True)
        return torch.tensor(frechet_distance(self.stats(real=False), reference), dtype=torch.float64)


class ADMFrechetInceptionDistance(_FrechetMetric):
    """FID as ADM computes it: Inception pool_3 (2048-d) Gaussians, float64, symmetric-sqrt trace.

    Args:
        extractor: the feature network (a plain module returning ``(N, D)`` features is wrapped by
            :class:`~.features.TensorFeatures`).
        reference: reference statistics (``mu``/``sigma`` of an ADM ``.npz``: a path, a
            :class:`~.reference.Reference` or :class:`~.frechet.GaussianStats`; a reference with images
            but no statistics is run through ``extractor`` once); None: ``update(images, real=True)``.
        batch_size: batch size for a reference's images.
        kwargs: torchmetrics ``Metric`` options (``sync_on_compute``, ``process_group``, ...).
    """

    _feature, _stats_key = "pool", "fid"


class SpatialFID(_FrechetMetric):
    """sFID as ADM computes it: the same distance over ``mixed_6/conv``'s first 7 channels, flattened
    (h, w, c) (2023-d for Inception); reference statistics are an ADM ``.npz``'s ``mu_s``/``sigma_s``.
    Arguments as :class:`ADMFrechetInceptionDistance`."""

    _feature, _stats_key = "spatial", "sfid"


class ADMInceptionScore(_ADMMetric):
    """Inception Score as ADM computes it: softmax over the 1008 unbiased logits, consecutive splits of
    ``split_size`` (5000) samples in update order, mean over splits. Real images (``real=True``) are ignored.

    Under DDP the splits follow the gathered order (process 0's samples first, then process 1's, ...).
    """

    higher_is_better = True

    def __init__(self, extractor: FeatureExtractor | nn.Module, split_size: int = ADM_SPLIT_SIZE, **kwargs) -> None:
        super().__init__(extractor, **kwargs)
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        self.split_size = split_size
        self.add_state("logits", [], dist_reduce_fx="cat")

    def update(self, images, real: bool = False) -> None:
        """Add uint8 sample images (or their features); ``real=True`` images are ignored."""
        if real:
            return
        self.logits.append(self._features(images)["logits_unbiased"].float().to(self.device))

    def compute(self) -> torch.Tensor:
        """The score (float64 scalar)."""
        logits = dim_zero_cat(self.logits).cpu().numpy()
        return torch.tensor(inception_score(logits, self.split_size), dtype=torch.float64)


class ADMPrecisionRecall(_ADMMetric):
    """Improved precision and recall (k = 3) of the samples' pool features against the reference's.

    Args:
        extractor: the feature network (or a plain module, as above).
        reference: the reference images' pool features: a :class:`~.reference.Reference` / path with images
            (``arr_0``; run through ``extractor`` once) or an ``(N, D)`` array; None: ``update(images, real=True)``.
        k, block_size, distance_dtype: as :func:`~.precision_recall.precision_recall` (``"float16"``: ADM's
            half-precision distances).
    ``compute()`` returns ``{"precision": ..., "recall": ...}`` (float64 scalars).
    """

    higher_is_better = True

    def __init__(
        self,
        extractor: FeatureExtractor | nn.Module,
        reference: Reference | np.ndarray | torch.Tensor | str | os.PathLike | None = None,
        k: int = ADM_K,
        block_size: int = 10000,
        distance_dtype: str = "float32",
        **kwargs,
    ) -> None:
        super().__init__(extractor, **kwargs)
        if distance_dtype not in DISTANCE_DTYPES:
            raise ValueError(f"distance_dtype must be one of {', '.join(DISTANCE_DTYPES)}, got {distance_dtype!r}")
        self.k, self.block_size, self.distance_dtype = k, block_size, distance_dtype
        self.add_state("real_pool", [], dist_reduce_fx="cat")
        self.add_state("fake_pool", [], dist_reduce_fx="cat")
        reference = _resolve_reference(reference)
        if isinstance(reference, Reference):
            if reference.images is None:
                raise ValueError(f"reference {reference.name} has no images (arr_0) for precision/recall")
            reference = torch.cat([f["pool"].cpu() for f in self._reference_features(reference.images)])
        elif reference is not None:
            reference = torch.as_tensor(np.asarray(reference) if not torch.is_tensor(reference) else reference).float()
            if reference.dim() != 2 or reference.shape[1] != self.extractor.pool_dim:
                raise ValueError(
                    f"reference features must be (N, {self.extractor.pool_dim}), got {tuple(reference.shape)}"
                )
        self.reference = reference

    def update(self, images, real: bool = False) -> None:
        """Add uint8 images (or their features) to the samples, or with ``real=True`` to the reference."""
        if real and self.reference is not None:
            raise ValueError("ADMPrecisionRecall was given reference features; real images cannot be added")
        (self.real_pool if real else self.fake_pool).append(self._features(images)["pool"].float().to(self.device))

    def compute(self) -> dict[str, torch.Tensor]:
        reference = self.reference if self.reference is not None else dim_zero_cat(self.real_pool).cpu()
        samples = dim_zero_cat(self.fake_pool).cpu()
        if min(len(reference), len(samples)) <= self.k:
            raise ValueError(
                f"precision/recall with k={self.k} need more than {self.k} images on each side, got "
                f"{len(samples)} samples and {len(reference)} reference images"
            )
        with exact_float32():
            precision, recall = precision_recall(
                reference,
                samples,
                k=self.k,
                block_size=self.block_size,
                device=self.extractor.device,
                distance_dtype=self.distance_dtype,
            )
        return {
            "precision": torch.tensor(precision, dtype=torch.float64),
            "recall": torch.tensor(recall, dtype=torch.float64),
        }
