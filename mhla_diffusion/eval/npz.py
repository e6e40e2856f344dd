"""ADM-format ``.npz`` batches, read and written in a streaming way.

Keys (as in ADM's reference batches and sample files):

* ``arr_0``: uint8 images, NHWC, 0..255 (samples: e.g. 50,000; reference: 10,000);
* ``arr_1``: class labels of the samples (optional; ignored by the metrics);
* ``mu``, ``sigma``: pool_3 mean ``(2048,)`` and covariance ``(2048, 2048)`` over the whole dataset;
* ``mu_s``, ``sigma_s``: sFID mean ``(2023,)`` and covariance ``(2023, 2023)``.

``arr_0`` is streamed batch by batch straight out of the zip member (stored or deflated), so a
50k x 256 x 256 x 3 file (9.8 GB) is never loaded whole; :class:`AdmNpzWriter` writes it the same way.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from .frechet import GaussianStats

__all__ = [
    "STATS_KEYS",
    "AdmNpzWriter",
    "NpzArrayInfo",
    "check_images_info",
    "iter_npz_batches",
    "npz_array_info",
    "npz_members",
    "read_npz_stats",
]

STATS_KEYS = {"fid": ("mu", "sigma"), "sfid": ("mu_s", "sigma_s")}


class NpzArrayInfo(NamedTuple):
    """Shape and dtype of one array inside an ``.npz``, read from its header only."""

    shape: tuple[int, ...]
    dtype: np.dtype


def _read_header(handle) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(handle)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(handle)
    elif version == (2, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(handle)
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    if fortran_order:
        raise ValueError("Fortran-ordered arrays are not supported; save the images C-contiguous (np.savez does)")
    return tuple(shape), dtype


def npz_members(path: str | os.PathLike) -> list[str]:
    """Array names stored in an ``.npz`` (``arr_0``, ``mu``, ...)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return [name[:-4] for name in archive.namelist() if name.endswith(".npy")]
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not an .npz file (not a zip archive)") from None


def npz_array_info(path: str | os.PathLike, key: str = "arr_0") -> NpzArrayInfo:
    """Shape and dtype of ``key`` without reading its data. ``KeyError`` if absent."""
    with zipfile.ZipFile(path) as archive:
        if f"{key}.npy" not in archive.namelist():
            raise KeyError(key)
        with archive.open(f"{key}.npy") as handle:
            return NpzArrayInfo(*_read_header(handle))


def check_images_info(path: str | os.PathLike, info: NpzArrayInfo) -> None:
    """Raise ``ValueError`` unless ``arr_0`` is uint8 ``(N, H, W, 3)``."""
    if info.dtype != np.uint8:
        raise ValueError(
            f"{path}: arr_0 has dtype {info.dtype}; ADM batches hold uint8 images 0..255 "
            "(convert with np.clip(np.floor(255 * x + 0.5), 0, 255).astype(np.uint8) for x in [0, 1])"
        )
    if len(info.shape) != 4 or info.shape[3] != 3:
        raise ValueError(f"{path}: arr_0 has shape {info.shape}; ADM batches hold RGB images (N, H, W, 3) (NHWC)")


def iter_npz_batches(path: str | os.PathLike, batch_size: int, key: str = "arr_0") -> Iterator[np.ndarray]:
    """Yield ``key`` in batches of up to ``batch_size`` along axis 0, reading only one batch at a time."""
    with zipfile.ZipFile(path) as archive, archive.open(f"{key}.npy") as handle:
        shape, dtype = _read_header(handle)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        for start in range(0, shape[0], batch_size):
            rows = min(batch_size, shape[0] - start)
            data = handle.read(rows * row_bytes)
            if len(data) != rows * row_bytes:
                raise ValueError(
                    f"{path}: {key} is truncated ({start + len(data) // max(row_bytes, 1)} of {shape[0]} rows)"
                )
            yield np.frombuffer(data, dtype=dtype).reshape((rows, *shape[1:]))


def read_npz_stats(path: str | os.PathLike) -> dict[str, GaussianStats]:
    """The stored statistics of an ``.npz``: ``{"fid": ..., "sfid": ...}`` for whichever pairs are present."""
    members = set(npz_members(path))
    found: dict[str, GaussianStats] = {}
    with np.load(path, allow_pickle=False) as data:
        for metric, (mu_key, sigma_key) in STATS_KEYS.items():
            if mu_key in members and sigma_key in members:
                try:
                    found[metric] = GaussianStats(data[mu_key], data[sigma_key])
                except ValueError as error:
                    raise ValueError(f"{path}: bad {mu_key}/{sigma_key}: {error}") from None
            elif mu_key in members or sigma_key in members:
                raise ValueError(f"{path} has only one of {mu_key} and {sigma_key}; both are needed")
    return found


class AdmNpzWriter:
    """Write an ADM ``.npz``: ``arr_0`` streamed batch by batch, then small arrays (labels, stats).

    Written to a temporary file next to ``path`` and renamed on :meth:`close`, so an interrupted
    write never leaves a truncated ``.npz`` behind. An existing ``path`` is an error unless
    ``overwrite``. Use as a context manager; on an exception the temporary file is removed::

        with AdmNpzWriter("samples.npz") as writer:
            writer.begin_images(50000, (256, 256))
            for batch in batches:              # uint8 (n, 256, 256, 3)
                writer.write_images(batch)
            writer.add_array("arr_1", labels)
    """

    def __init__(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        self.path = Path(path)
        if self.path.suffix != ".npz":
            raise ValueError(f"{self.path}: the output must end in .npz")
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} already exists; choose another path or pass --overwrite")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._archive = zipfile.ZipFile(self._tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._member = None
        self.shape: tuple[int, int, int, int] | None = None
        self.written = 0

    def begin_images(self, num_images: int, image_size: tuple[int, int]) -> None:
        """Start ``arr_0`` with room for exactly ``num_images`` uint8 images of ``image_size`` (H, W)."""
        if self.shape is not None:
            raise RuntimeError("arr_0 was already started")
        self.shape = (int(num_images), int(image_size[0]), int(image_size[1]), 3)
        self._member = self._archive.open("arr_0.npy", "w", force_zip64=True)
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
            "fortran_order": False,
            "shape": self.shape,
        }
        np.lib.format.write_array_header_1_0(self._member, header)

    def write_images(self, images: np.ndarray) -> None:
        """Append uint8 images ``(n, H, W, 3)``."""
        if self._member is None:
            raise RuntimeError("call begin_images before write_images (and before add_array)")
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.shape[1:] != self.shape[1:]:
            raise ValueError(
                f"expected uint8 images of shape (n, {self.shape[1]}, {self.shape[2]}, 3), "
                f"got {images.dtype} {images.shape}"
            )
        if self.written + images.shape[0] > self.shape[0]:
            raise ValueError(f"more images than the {self.shape[0]} announced")
        self._member.write(np.ascontiguousarray(images).tobytes())
        self.written += images.shape[0]

    def _finish_images(self) -> None:
        if self._member is not None:
            if self.written != self.shape[0]:
                raise ValueError(f"{self.written} images written, {self.shape[0]} announced")
            self._member.close()
            self._member = None

    def add_array(self, name: str, array: np.ndarray) -> None:
        """Store a further array (e.g. ``arr_1`` labels, ``mu``, ``sigma``) after all images."""
        self._finish_images()
        with self._archive.open(f"{name}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)

    def close(self) -> Path:
        """Finish and move the file into place. Returns the path."""
        self._finish_images()
        self._archive.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file."""
        try:
            if self._member is not None:
                self._member.close()
            self._archive.close()
        finally:
            self._member = None
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "AdmNpzWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:
            self.abort()
            raise
