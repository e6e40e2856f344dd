"""Pieces shared by the video and image datasets: the data report, probing sharded across
processes, per-sample random numbers that do not depend on process or worker, and loading with a
fallback for files that break after indexing."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from .media import MediaError, MediaInfo, probe

__all__ = ["DataReport", "datasets_root_hint", "probe_sharded", "sample_rng", "load_with_fallback"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Folder names the Hugging Face ``datasets`` folder builders (imagefolder, videofolder) read as splits.
SPLIT_FOLDERS = frozenset(
    {"train", "training", "test", "testing", "validation", "valid", "val", "dev", "eval", "evaluation"}
)


@dataclass
class DataReport:
    """What indexing found: files used and files skipped, by reason (logged and sent to trackers)."""

    found: int = 0
    used: int = 0
    corrupt: list[str] = field(default_factory=list)
    too_short: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{self.used} of {self.found} files used"]
        if self.corrupt:
            parts.append(f"{len(self.corrupt)} corrupt skipped (e.g. {self.corrupt[:3]})")
        if self.too_short:
            parts.append(
                f"{len(self.too_short)} shorter than the smallest frame bucket skipped (e.g. {self.too_short[:3]})"
            )
        return "; ".join(parts)

    def metrics(self) -> dict[str, int]:
        return {
            "data/files_found": self.found,
            "data/files_used": self.used,
            "data/skipped_corrupt": len(self.corrupt),
            "data/skipped_too_short": len(self.too_short),
        }

    def warn(self) -> None:
        for path in self.corrupt:
            logger.warning("skipping corrupt or unreadable file %s", path)
        for path in self.too_short:
            logger.warning("skipping %s: fewer frames than the smallest frame bucket", path)
        logger.info("data: %s", self.summary())

    def to_dict(self) -> dict[str, Any]:
        return {"found": self.found, "used": self.used, "corrupt": self.corrupt, "too_short": self.too_short}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DataReport":
        return cls(**data)


def datasets_root_hint(folder: Path) -> str | None:
    """The error for a data folder that is the root of a ``datasets`` imagefolder / videofolder (its split
    folders, ``train/`` among them, instead of the training files), else None.

    A root is recognised by a ``train/`` sub-folder holding ``metadata.jsonl`` / ``metadata.csv``, or by
    sub-folders that are all split names.
    """
    train = folder / "train"
    if not train.is_dir():
        return None
    subfolders = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    metadata = any((train / name).is_file() for name in ("metadata.jsonl", "metadata.csv"))
    if not metadata and not set(subfolders) <= SPLIT_FOLDERS:
        return None
    return f"{folder} looks like a `datasets` folder (split folders {', '.join(subfolders)}): use {train} as data_dir"


def probe_sharded(
    paths: Sequence[Path],
    rank: int = 0,
    world: int = 1,
    gather: Callable[[list], list] | None = None,
    check: Callable[[Path], MediaInfo] = probe,
) -> list[MediaInfo | str]:
    """``check`` every path, process ``rank`` taking every ``world``-th one; results are gathered.

    Returns, per path in order, its :class:`MediaInfo` or the error message of a :class:`MediaError`.
    ``gather`` concatenates the per-process lists across processes (accelerate's ``gather_object``).
    """
    mine = []
    for index in range(rank, len(paths), world):
        try:
            mine.append((index, check(paths[index])))
        except MediaError as err:
            mine.append((index, str(err)))
    everything = gather(mine) if gather is not None and world > 1 else mine
    results: list[MediaInfo | str | None] = [None] * len(paths)
    for index, result in everything:
        results[index] = result
    missing = [str(paths[i]) for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"probing lost {len(missing)} files across processes (e.g. {missing[:3]})")
    return results  # type: ignore[return-value]


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """Random numbers for one sample in one epoch: the same in every process, worker and resumed run."""
    return random.Random(f"{seed}/{epoch}/{index}")


def load_with_fallback(load: Callable[[int], T], index: int, alternatives: Sequence[int]) -> T:
    """``load(index)``; if the file broke after indexing, warn and load the next readable alternative.

    ``alternatives`` are the other samples of the same bucket, so the batch keeps one shape.
    """
    try:
        return load(index)
    except MediaError as err:
        logger.warning("skipping unreadable sample: %s", err)
    start = alternatives.index(index) if index in alternatives else -1
    for other in list(alternatives[start + 1 :]) + list(alternatives[: max(start, 0)]):
        try:
            return load(other)
        except MediaError as err:
            logger.warning("skipping unreadable sample: %s", err)
    raise MediaError(f"no readable sample left in the bucket of sample {index}")
