"""Class-to-image data: scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes).

Real data that ships with scikit-learn (nothing is downloaded), upsampled bicubically to RGB
``size`` x ``size`` (white digit on black), split deterministically into train / held-out per class,
and written as the DiT trainer's image folder ``folder/<class>/<index>.png``
(:mod:`mhla_diffusion.finetune.image_data`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ...pipelines.outputs import float_to_uint8

__all__ = ["DIGIT_SIZE", "NUM_DIGIT_CLASSES", "DigitSplit", "load_digits_images", "split_digits", "write_digits_folder"]

DIGIT_SIZE = 32
NUM_DIGIT_CLASSES = 10


@dataclass(frozen=True)
class DigitSplit:
    """uint8 images ``(n, size, size, 3)``, int64 labels ``(n,)`` and indices into the full set, per side."""

    train_images: np.ndarray
    train_labels: np.ndarray
    train_indices: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    test_indices: np.ndarray


def load_digits_images(size: int = DIGIT_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """All digits upsampled -> uint8 ``(1797, size, size, 3)`` and int64 labels ``(1797,)``."""
    if size < 8:
        raise ValueError(f"size must be >= 8 (the digits are 8x8), got {size}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the digits data needs scikit-learn: pip install scikit-learn") from err
    digits = load_digits()
    small = float_to_uint8(digits.images / 16.0)  # values 0..16 -> 0..255
    big = np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.BICUBIC)) for im in small])
    return np.repeat(big[..., None], 3, axis=-1), digits.target.astype(np.int64)


def split_digits(seed: int = 0, held_out_fraction: float = 0.2, size: int = DIGIT_SIZE) -> DigitSplit:
    """A stratified split: ``round(held_out_fraction * n_c)`` images of every class ``c`` are held out.

    Which ones is a seeded permutation per class; both sides are in ascending index order.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    images, labels = load_digits_images(size)
    rng = np.random.default_rng(seed)
    held_out = np.zeros(len(labels), dtype=bool)
    for c in range(NUM_DIGIT_CLASSES):
        members = np.flatnonzero(labels == c)
        held_out[rng.permutation(members)[: round(held_out_fraction * len(members))]] = True
    train, test = np.flatnonzero(~held_out), np.flatnonzero(held_out)
    return DigitSplit(images[train], labels[train], train, images[test], labels[test], test)


def write_digits_folder(
    folder: str | Path,
    images: np.ndarray,
    labels: np.ndarray,
    overwrite: bool = False,
    indices: np.ndarray | None = None,
) -> Path:
    """Write uint8 ``images`` ``(n, H, W, 3)`` as ``folder/<label>/<index:04d>.png``; returns ``folder``.

    ``indices`` name the files (default ``0..n-1``; pass a split's indices to keep the original ids).
    An existing non-empty ``folder`` is an error unless ``overwrite``, which deletes it first.
    """
    folder = Path(folder)
    images, labels = np.asarray(images), np.asarray(labels)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 (n, H, W, 3), got {images.dtype} {images.shape}")
    if labels.shape != (len(images),):
        raise ValueError(f"labels must have shape ({len(images)},), got {labels.shape}")
    indices = np.arange(len(images)) if indices is None else np.asarray(indices)
    if indices.shape != (len(images),) or len(set(indices.tolist())) != len(images):
        raise ValueError(f"indices must be {len(images)} distinct numbers, got shape {indices.shape}")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{folder} exists and is not empty; choose another folder or pass overwrite=True")
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
    for image, label, index in zip(images, labels, indices):
        (folder / str(int(label))).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / str(int(label)) / f"{int(index):04d}.png")
    return folder
