"""Image sources for evaluation: a folder of image files, an ADM ``.npz``, or an in-memory array.

Every source yields uint8 batches ``(n, H, W, 3)`` (NHWC, RGB, 0..255) of one fixed size, in a fixed
order, and knows its length and image size before any image is decoded.

A folder is scanned first (header read and integrity check of every file, no decoding): unreadable
files are an error that lists them, unless ``skip_corrupt=True``, which skips them and reports
them in :attr:`ImageSource.skipped`. Pixel formats: 8-bit images as Pillow converts them to RGB,
16-bit greyscale and 16-bit RGB(A) PNGs scaled by ``round(x / 257)``, float greyscale in [0, 1] by
the project's float -> uint8 rule; any other format (32-bit integer, float outside [0, 1]) is an error naming the file,
also with ``skip_corrupt=True``.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from PIL import Image

from ..pipelines.outputs import float_to_uint8
from .npz import check_images_info, iter_npz_batches, npz_array_info, npz_members

__all__ = [
    "IMAGE_EXTENSIONS",
    "ArrayImages",
    "FolderImages",
    "ImageSource",
    "NpzImages",
    "UnsupportedImage",
    "open_images",
]

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})
_READ_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)
_LISTED = 20


class ImageSource(ABC):
    """A fixed, ordered set of same-size RGB images."""

    name: str
    image_size: tuple[int, int]
    #: Class labels ``(N,)`` if the source stores them (``arr_1`` of a sample ``.npz``), else None.
    labels: np.ndarray | None = None
    #: Names of unreadable images that were skipped (only with ``skip_corrupt=True``).
    skipped: list[str]

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def iter_batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Yield uint8 batches ``(n <= batch_size, H, W, 3)`` in order."""


class ArrayImages(ImageSource):
    """Images already in memory: uint8 ``(N, H, W, 3)``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray | None = None, name: str = "array") -> None:
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3 or images.shape[0] == 0:
            raise ValueError(f"expected uint8 images (N, H, W, 3) with N >= 1, got {images.dtype} {images.shape}")
        self.images, self.labels, self.name = images, labels, name
        self.image_size = (images.shape[1], images.shape[2])
        self.skipped = []

    def __len__(self) -> int:
        return self.images.shape[0]

    def iter_batches(self, batch_size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self), batch_size):
            yield self.images[start : start + batch_size]


class NpzImages(ImageSource):
    """``arr_0`` of an ADM ``.npz`` (uint8 NHWC), streamed; ``arr_1`` becomes :attr:`labels` if present."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.name = str(path)
        members = npz_members(path)
        if "arr_0" not in members:
            raise ValueError(f"{path} has no images (arr_0); keys: {', '.join(members) or 'none'}")
        info = npz_array_info(path)
        check_images_info(path, info)
        if info.shape[0] == 0:
            raise ValueError(f"{path}: arr_0 holds no images")
        self._count = info.shape[0]
        self.image_size = (info.shape[1], info.shape[2])
        self.skipped = []
        if "arr_1" in members and npz_array_info(path, "arr_1").shape == (self._count,):
            with np.load(path, allow_pickle=False) as data:
                self.labels = data["arr_1"]

    def __len__(self) -> int:
        return self._count

    def iter_batches(self, batch_size: int) -> Iterator[np.ndarray]:
        return iter_npz_batches(self.path, batch_size)


#: 8-bit modes that ``Image.convert("RGB")`` maps faithfully (alpha is dropped).
_EIGHT_BIT_MODES = frozenset({"1", "L", "P", "RGB", "RGBA", "RGBX", "RGBa", "LA", "La", "PA", "CMYK", "YCbCr"})
#: 16-bit single-channel modes: scaled to 8 bits by ``round(x / 257)``.
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_FLOAT_MODES = frozenset({"F"})
_SUPPORTED_MODES = _EIGHT_BIT_MODES | _SIXTEEN_BIT_MODES | _FLOAT_MODES
_CONVERT_HINT = "convert it to an 8-bit RGB (or greyscale) PNG first"


class UnsupportedImage(ValueError):
    """An image whose pixel format evaluation cannot convert to uint8 RGB without guessing (never skipped)."""


def _unsupported_mode(path: Path, mode: str) -> str:
    return (
        f"{path}: pixel mode {mode!r} is not supported for evaluation (supported: 8-bit images, 16-bit "
        f"greyscale or RGB(A) PNGs, float greyscale in [0, 1]); {_CONVERT_HINT}"
    )


def _probe(path: Path) -> tuple[tuple[int, int] | None, str | None, str | None]:
    """``((H, W), None, mode)`` for a readable image file, ``(None, reason, None)`` otherwise (no full decode)."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            mode = image.mode
            image.verify()
        return (height, width), None, mode
    except _READ_ERRORS as error:
        return None, f"{type(error).__name__}: {error}", None


#: Pillow's raw modes of 16-bit RGB(A) PNGs -> the raw mode that unpacks the low byte of each sample.
_PNG_16_BIT_LOW_BYTES = {"RGB;16B": "RGB;16L", "RGBA;16B": "RGBA;16L"}


def _png_16_bit_rgb(path: Path) -> np.ndarray | None:
    """``round(x / 257)`` of a (non-interlaced) 16-bit RGB / RGBA PNG as uint8 ``(H, W, 3)``; None for others.

    Pillow opens these as 8-bit RGB keeping each sample's high byte (``x >> 8``). Decoding once more with
    the little-endian raw mode gives the low bytes (same unfiltering, the other byte of each sample).
    """
    planes = []
    for low_bytes in (False, True):
        with Image.open(path) as image:
            tile = image.tile[0] if image.format == "PNG" and len(image.tile) == 1 else None
            if tile is None or not isinstance(tile.args, str) or tile.args not in _PNG_16_BIT_LOW_BYTES:
                return None
            if low_bytes:
                image.tile = [tile._replace(args=_PNG_16_BIT_LOW_BYTES[tile.args])]
            planes.append(np.asarray(image.convert("RGB")).astype(np.float64))
    high, low = planes
    return np.rint((256 * high + low) / 257).astype(np.uint8)


def _load_rgb(path: Path) -> np.ndarray:
    """uint8 ``(H, W, 3)`` of an image file: 8-bit modes as Pillow converts them, 16-bit greyscale and
    16-bit RGB(A) PNGs scaled by ``round(x / 257)``, float greyscale in [0, 1] with the project's one
    float -> uint8 rule (:func:`mhla_diffusion.pipelines.outputs.float_to_uint8`). Anything else is
    :class:`UnsupportedImage`."""
    sixteen_bit_rgb = _png_16_bit_rgb(path)
    if sixteen_bit_rgb is not None:
        return sixteen_bit_rgb
    with Image.open(path) as image:
        mode = image.mode
        if mode in _EIGHT_BIT_MODES:
            return np.asarray(image.convert("RGB"))
        if mode in _SIXTEEN_BIT_MODES:
            grey = np.rint(np.asarray(image).astype(np.float64) / 257).astype(np.uint8)
        elif mode in _FLOAT_MODES:
            values = np.asarray(image)
            finite = bool(np.isfinite(values).all())
            low, high = (float(np.nanmin(values)), float(np.nanmax(values))) if values.size else (0.0, 0.0)
            if not finite or low < 0 or high > 1:
                raise UnsupportedImage(
                    f"{path}: float image with values in [{low:g}, {high:g}]"
                    + ("" if finite else " and non-finite values")
                    + "; evaluation only converts float images with values in [0, 1]: rescale it to [0, 1] or "
                    + _CONVERT_HINT
                )
            grey = float_to_uint8(values)
        else:
            raise UnsupportedImage(_unsupported_mode(path, mode))
    return np.repeat(grey[..., None], 3, axis=2)


def _name_list(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


class FolderImages(ImageSource):
    """Image files under a folder (recursively, sorted by relative path; hidden files ignored).

    Args:
        path: the folder.
        skip_corrupt: skip unreadable files (listed in :attr:`skipped` and logged) instead of raising.
        workers: threads that read and decode files.
    """

    def __init__(self, path: str | os.PathLike, skip_corrupt: bool = False, workers: int = 4) -> None:
        self.path = Path(path)
        self.name = str(path)
        self.skip_corrupt = skip_corrupt
        self.workers = max(1, workers)
        files = sorted(
            p
            for p in self.path.rglob("*")
            if p.suffix.lower() in IMAGE_EXTENSIONS
            and not any(part.startswith(".") for part in p.relative_to(self.path).parts)
            and p.is_file()
        )
        if not files:
            raise ValueError(f"{path} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
        with ThreadPoolExecutor(self.workers) as pool:
            probes = list(pool.map(_probe, files))
        unsupported = [
            f"{self._rel(p)} ({mode})"
            for p, (_, _, mode) in zip(files, probes)
            if mode is not None and mode not in _SUPPORTED_MODES
        ]
        if unsupported:
            raise UnsupportedImage(
                f"{len(unsupported)} of {len(files)} images in {path} have a pixel mode evaluation cannot convert "
                f"to 8-bit RGB without guessing: {_name_list(unsupported)}. Supported: 8-bit images, 16-bit "
                f"greyscale or RGB(A) PNGs, float greyscale in [0, 1]; convert them to 8-bit RGB (or greyscale) "
                "PNGs first"
            )
        probes = [(size, reason) for size, reason, _ in probes]
        bad = [f"{self._rel(p)} ({reason})" for p, (_, reason) in zip(files, probes) if reason is not None]
        if bad and not skip_corrupt:
            raise ValueError(
                f"{len(bad)} of {len(files)} images in {path} cannot be read: {_name_list(bad)}. "
                "Replace or remove them, or pass --skip-corrupt (skip_corrupt=True) to evaluate without them"
            )
        self.skipped = [self._rel(p) for p, (_, reason) in zip(files, probes) if reason is not None]
        if self.skipped:
            logger.warning("skipping %d unreadable images in %s: %s", len(bad), path, _name_list(bad))
        self.files = [p for p, (size, _) in zip(files, probes) if size is not None]
        if not self.files:
            raise ValueError(f"none of the {len(files)} images in {path} can be read")
        sizes = Counter(size for size, _ in probes if size is not None)
        if len(sizes) > 1:
            listed = ", ".join(f"{h}x{w} ({n} images)" for (h, w), n in sizes.most_common(5))
            raise ValueError(
                f"images in {path} have different sizes (HxW): {listed}. Evaluation needs one size: "
                "resize/center-crop them first (ADM's reference batches are center-cropped squares)"
            )
        self.image_size = next(iter(sizes))

    def _rel(self, path: Path) -> str:
        return str(path.relative_to(self.path))

    def __len__(self) -> int:
        return len(self.files)

    def _read(self, path: Path) -> np.ndarray | None:
        try:
            image = _load_rgb(path)
        except UnsupportedImage:
            raise
        except _READ_ERRORS as error:
            if not self.skip_corrupt:
                raise ValueError(
                    f"cannot decode {path} ({type(error).__name__}: {error}); replace or remove it, "
                    "or pass --skip-corrupt (skip_corrupt=True)"
                ) from None
            logger.warning("skipping %s: cannot decode (%s)", path, error)
            self.skipped.append(self._rel(path))
            return None
        if image.shape[:2] != self.image_size:
            raise ValueError(
                f"{path} decodes to {image.shape[0]}x{image.shape[1]}, expected "
                f"{self.image_size[0]}x{self.image_size[1]}"
            )
        return image

    def iter_batches(self, batch_size: int) -> Iterator[np.ndarray]:
        with ThreadPoolExecutor(self.workers) as pool:
            for start in range(0, len(self.files), batch_size):
                images = [im for im in pool.map(self._read, self.files[start : start + batch_size]) if im is not None]
                if images:
                    yield np.stack(images)


def open_images(path: str | os.PathLike, skip_corrupt: bool = False, workers: int = 4) -> ImageSource:
    """A folder of images -> :class:`FolderImages`; an ``.npz`` with ``arr_0`` -> :class:`NpzImages`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        return FolderImages(path, skip_corrupt=skip_corrupt, workers=workers)
    if path.suffix == ".npz":
        return NpzImages(path)
    raise ValueError(f"{path}: expected a folder of images or an ADM .npz (arr_0 uint8 NHWC)")
