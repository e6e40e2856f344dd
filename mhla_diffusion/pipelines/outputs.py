"""Writing generated videos and images, each with its settings as JSON beside it.

Nothing is overwritten unless asked: every path a run will write is planned and checked first,
before any model is loaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = [
    "OutputPlan",
    "VIDEO_FORMATS",
    "VideoWriter",
    "check_settings",
    "float_to_uint8",
    "plan_outputs",
    "save_image",
    "save_video",
    "slugify",
    "write_settings",
]

#: Video outputs: H.264 mp4, animated gif, or a folder of PNG frames.
VIDEO_FORMATS = ("mp4", "gif", "frames")
_SUFFIXES = {"mp4": ".mp4", "gif": ".gif", "frames": "", "png": ".png"}


def slugify(text: str, max_length: int = 40, fallback: str = "prompt") -> str:
    """A file-name-safe short form of a prompt or label.

    Letters, marks and digits of any script are kept (lower-cased); everything else (spaces, punctuation,
    emoji, symbols) becomes one ``-``. ``fallback`` when nothing is left.
    """
    kept = "".join(
        c if unicodedata.category(c)[0] in "LMN" else "-" for c in unicodedata.normalize("NFC", text.lower())
    )
    slug = re.sub(r"-+", "-", kept).strip("-")
    return slug[:max_length].rstrip("-") or fallback


@dataclass(frozen=True)
class OutputPlan:
    """Where one generated item goes: ``media`` (a file, or a folder of PNG frames) and ``settings`` JSON."""

    media: Path
    settings: Path


def plan_outputs(
    output_dir: str | os.PathLike, stems: Sequence[str], fmt: str, overwrite: bool = False
) -> list[OutputPlan]:
    """Plan ``output_dir/<stem><suffix>`` + ``<stem>.json`` per stem; refuse clashes and unwritable folders.

    ``fmt``: a video format (``mp4``, ``gif``, ``frames`` = folder of PNGs) or ``png`` for images.
    """
    if fmt not in _SUFFIXES:
        raise ValueError(f"unknown output format {fmt!r}: choose one of {', '.join(VIDEO_FORMATS)}")
    folder = Path(output_dir)
    if len(set(stems)) != len(stems):
        raise ValueError("two outputs would get the same file name; give distinct prompts/classes or seeds")
    plans = [OutputPlan(folder / f"{stem}{_SUFFIXES[fmt]}", folder / f"{stem}.json") for stem in stems]
    existing = [str(p) for plan in plans for p in (plan.media, plan.settings) if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{len(existing)} output(s) already exist, e.g. {existing[:3]}; pass --overwrite or another --output-dir"
        )
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output-dir {folder} exists and is not a folder")
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"cannot create --output-dir {folder}: {probe} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write to {folder}: {probe} is not writable; choose another --output-dir")
    _try_writing(folder)
    return plans


def _try_writing(folder: Path) -> None:
    """Create ``folder`` and a file in it, then remove what was made: ``os.access`` alone passes folders
    such as ``/proc`` (or read-only mounts, for root) where nothing can be created."""
    created = []
    missing = folder
    while not missing.exists():
        created.append(missing)
        missing = missing.parent
    try:
        for path in reversed(created):
            path.mkdir()
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise PermissionError(
            f"cannot write to --output-dir {folder} ({reason}); choose another --output-dir"
        ) from None
    finally:
        for path in created:
            try:
                path.rmdir()
            except OSError:
                pass


def float_to_uint8(array: np.ndarray) -> np.ndarray:
    """``float`` in [0, 1] (what pipelines return for ``output_type="np"``) -> ``uint8``; ``uint8`` passes through.

    The one float -> uint8 rule of the project: ``floor(255 x + 0.5)`` clipped to [0, 255], in float64,
    which is DiT's ``sample_ddp.py`` rounding (``clamp(127.5 s + 128, 0, 255)`` then truncation).
    """
    array = np.asarray(array)
    if array.dtype == np.uint8:
        return array
    return np.clip(np.floor(255 * array.astype(np.float64) + 0.5), 0, 255).astype(np.uint8)


def save_video(frames: np.ndarray, plan: OutputPlan, fmt: str, fps: int) -> Path:
    """Write ``frames`` ``(F, H, W, 3)`` as mp4 (H.264, through :class:`VideoWriter`), gif, or a folder of PNGs."""
    import imageio.v3 as iio

    frames = float_to_uint8(np.asarray(frames))
    if fmt == "gif":
        plan.media.parent.mkdir(parents=True, exist_ok=True)
        iio.imwrite(plan.media, frames, extension=".gif", duration=1000 / fps, loop=0)
        return plan.media
    with VideoWriter(plan, fmt, fps) as writer:
        writer.append(frames)
    return plan.media


class VideoWriter:
    """Writes a video as its frames come (a streamed generation), so that the file is a playable video after every
    :meth:`append`, also when the process is killed: an mp4 (H.264) whose every append is whole fragments
    (:class:`~mhla_diffusion.pipelines.fragmented_mp4.FragmentedMP4Writer`; closing rewrites it as an ordinary mp4),
    or a folder of PNG frames, each written whole under a temporary name and then renamed. A GIF is encoded whole
    at the end, so it cannot be appended to: :func:`save_video` writes it.

    Use as a context manager; leaving the block (also on an error or Ctrl-C) closes the file.
    """

    #: The formats a video can be appended to.
    FORMATS = ("mp4", "frames")

    def __init__(self, plan: OutputPlan, fmt: str, fps: int) -> None:
        if fmt not in self.FORMATS:
            raise ValueError(f"a {fmt} video cannot be written frame by frame: choose one of {', '.join(self.FORMATS)}")
        self.plan, self.fmt, self.fps = plan, fmt, fps
        self.frames_written = 0
        self._mp4 = None

    def __enter__(self) -> "VideoWriter":
        self.plan.media.parent.mkdir(parents=True, exist_ok=True)
        if self.fmt == "mp4":
            from .fragmented_mp4 import FragmentedMP4Writer

            self._mp4 = FragmentedMP4Writer(self.plan.media, self.fps)
        else:
            self.plan.media.mkdir(parents=True, exist_ok=True)
        return self

    def append(self, frames: np.ndarray) -> None:
        """Add ``frames`` ``(F, H, W, 3)`` (floats in [0, 1] or ``uint8``) after those written so far; they are in
        the file when this returns."""
        frames = float_to_uint8(np.asarray(frames))
        if self._mp4 is not None:
            self._mp4.append(frames)
            self.frames_written += len(frames)
            return
        import imageio.v3 as iio

        for frame in frames:
            path = self.plan.media / f"frame_{self.frames_written:04d}.png"
            partial = path.with_name(f".{path.name}.partial")
            iio.imwrite(partial, frame, extension=".png")
            os.replace(partial, path)
            self.frames_written += 1

    def __exit__(self, *exc_info: Any) -> None:
        if self._mp4 is not None:
            self._mp4.close()
            self._mp4 = None


def save_image(image: np.ndarray, plan: OutputPlan) -> Path:
    """Write one image ``(H, W, 3)`` as PNG at ``plan.media``."""
    import imageio.v3 as iio

    plan.media.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(plan.media, float_to_uint8(np.asarray(image)))
    return plan.media


def check_settings(settings: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every non-finite number in ``settings`` (JSON has no NaN or infinity)."""
    bad = [key for key, value in _numbers(settings) if isinstance(value, float) and not math.isfinite(value)]
    if bad:
        raise ValueError(f"settings {', '.join(bad)} must be finite numbers (JSON cannot hold NaN or infinity)")


def _numbers(value: Any, key: str = ""):
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{key}[{index}]")
    else:
        yield key, value


def write_settings(plan: OutputPlan, settings: dict[str, Any]) -> Path:
    """Write the run's settings next to its output, as strict JSON (non-finite numbers are a ``ValueError``); the
    file is replaced whole, so a reader (or a run killed while writing it) never sees half of it."""
    check_settings(settings)
    text = json.dumps(settings, indent=2, default=str, allow_nan=False)
    plan.settings.parent.mkdir(parents=True, exist_ok=True)
    partial = plan.settings.with_name(f".{plan.settings.name}.partial")
    partial.write_text(text + "\n")
    os.replace(partial, plan.settings)
    return plan.settings
