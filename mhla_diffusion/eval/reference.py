"""Reference batches: an ADM ``.npz`` (stored ``mu, sigma, mu_s, sigma_s`` and/or images ``arr_0``) or
a folder of images, and the check that stored statistics fit a feature network."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .features import FeatureExtractor
from .frechet import GaussianStats
from .images import ImageSource, NpzImages, open_images
from .npz import npz_members, read_npz_stats

__all__ = ["Reference", "check_reference_dims", "load_reference"]


@dataclass
class Reference:
    """A reference batch: its images (for P/R, or statistics when none are stored) and stored statistics."""

    name: str
    images: ImageSource | None
    stats: dict[str, GaussianStats] = field(default_factory=dict)  # "fid" and/or "sfid"


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


def check_reference_dims(reference: Reference, extractor: FeatureExtractor) -> None:
    expected = {"fid": extractor.pool_dim, "sfid": extractor.spatial_dim}
    for metric, stats in reference.stats.items():
        if stats.dim != expected[metric]:
            raise ValueError(
                f"reference {reference.name}: stored {metric} statistics are {stats.dim}-d but the feature "
                f"network gives {expected[metric]}-d features; they were computed with another network"
            )
