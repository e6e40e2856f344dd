"""Text-to-video data: a folder of videos (and images) with captions.

Captions come from ``metadata.jsonl`` or ``metadata.csv`` at the top of the folder (a path column
relative to the folder: ``file_name``/``video``/``image``/``path`` or the one named by
``file_column``, as DiffSynth-Studio's ``video,prompt`` files; a caption column
``text``/``caption``/``prompt`` or the one named by ``caption_column``; optional
``num_frames``/``height``/``width`` skip probing), from finetrainers' ``prompts.txt`` +
``videos.txt`` (line i of one captions line i of the other), from a Hugging Face ``datasets``
folder saved with ``save_to_disk`` in the data folder (same columns; paths relative to the folder;
needs ``datasets`` installed), or from a sidecar ``<name>.txt`` beside each file.
Images are one-frame videos. Each file goes to the
resolution bucket of nearest aspect ratio and the largest frame bucket it can fill.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from .buckets import frame_bucket, nearest_resolution
from .data import DataReport, datasets_root_hint, load_with_fallback, probe_sharded, sample_rng
from .media import IMAGE_EXTENSIONS, MediaInfo, is_media, read_image, read_video_frames, resize_center_crop

__all__ = [
    "CachedVideoDataset",
    "VideoSample",
    "VideoTextDataset",
    "collate_cached_video",
    "collate_pixels",
    "index_video_folder",
    "latent_identity",
    "read_captions",
]

logger = logging.getLogger(__name__)

CAPTION_COLUMNS = ("text", "caption", "prompt")
FILE_COLUMNS = ("file_name", "video", "image", "path")


@dataclass(frozen=True)
class VideoSample:
    """One training file: where it is, its caption, its size, and its bucket ``(frames, height, width)``."""

    path: str
    key: str  # path relative to the data folder (names cache entries)
    caption: str
    num_frames: int
    height: int
    width: int
    bucket: tuple[int, int, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VideoSample":
        return cls(**{**data, "bucket": tuple(data["bucket"])})


def _metadata_rows(folder: Path) -> tuple[Path, list[dict[str, Any]]] | None:
    jsonl, csv_path = folder / "metadata.jsonl", folder / "metadata.csv"
    if jsonl.is_file() and csv_path.is_file():
        raise ValueError(f"{folder} has both metadata.jsonl and metadata.csv: keep one")
    if jsonl.is_file():
        rows = []
        for number, line in enumerate(jsonl.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{jsonl} line {number} is not JSON ({err})") from None
        return jsonl, rows
    if csv_path.is_file():
        with csv_path.open(newline="") as handle:
            return csv_path, list(csv.DictReader(handle))
    saved = _saved_dataset_rows(folder)
    if saved is not None:
        return saved
    prompts, videos = folder / "prompts.txt", folder / "videos.txt"
    if prompts.is_file() != videos.is_file():
        have, lack = (prompts, videos) if prompts.is_file() else (videos, prompts)
        raise ValueError(
            f"{have} needs {lack.name} beside it (finetrainers layout: line i of prompts.txt captions "
            "the file on line i of videos.txt)"
        )
    if prompts.is_file():
        captions = [line.strip() for line in prompts.read_text().splitlines()]
        paths = [line.strip() for line in videos.read_text().splitlines()]
        while captions and not captions[-1]:
            captions.pop()
        while paths and not paths[-1]:
            paths.pop()
        if len(captions) != len(paths):
            raise ValueError(f"{prompts} has {len(captions)} lines but {videos} has {len(paths)}: one prompt per video")
        return videos, [{"file_name": p, "text": c} for p, c in zip(paths, captions) if p]
    return None


def _saved_dataset_rows(folder: Path) -> tuple[Path, list[dict[str, Any]]] | None:
    """Rows of a Hugging Face ``datasets`` folder written by ``save_to_disk`` (a ``DatasetDict``: its ``train``).

    Media columns (``Image`` / ``Video`` features) are read undecoded and give their file's path.
    Returns ``None`` when ``folder`` holds no saved dataset.
    """
    if (folder / "dataset_dict.json").is_file():
        marker = folder / "dataset_dict.json"
    elif (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        marker = folder / "state.json"
    else:
        return None
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{folder} is a Hugging Face datasets folder (save_to_disk): `pip install datasets` to "
            "train on it, or give a metadata.jsonl / metadata.csv"
        ) from None
    data = datasets.load_from_disk(str(folder))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(
                f"{folder} holds the splits {sorted(data)} but no `train` split: save the training split "
                "as `train` (or alone)"
            )
        data = data["train"]
    for name, feature in data.features.items():
        if type(feature).__name__ in ("Image", "Video"):  # keep {"path", "bytes"} instead of decoding
            data = data.cast_column(name, type(feature)(decode=False))
    rows = []
    for row in data:
        for key, value in row.items():
            if isinstance(value, dict) and "path" in value:
                if not value.get("path") or (value.get("bytes") and not (folder / value["path"]).is_file()):
                    raise ValueError(
                        f"{marker}: column `{key}` holds the media's bytes, not paths of files under {folder}; the "
                        "trainer reads files: write the media out as files under the data folder and store their "
                        "relative paths (or use a metadata.jsonl)"
                    )
                row[key] = value["path"]
        rows.append(row)
    return marker, rows


def read_captions(
    folder: Path, files: list[Path], caption_column: str | None = None, file_column: str | None = None
) -> tuple[dict[Path, str], dict[Path, dict]]:
    """Captions of ``files`` (and size hints from metadata). Raises when any file has none.

    Returns ``{file: caption}`` and ``{file: {num_frames, height, width}}`` for metadata rows that give all three.
    """
    captions: dict[Path, str] = {}
    hints: dict[Path, dict] = {}
    found = _metadata_rows(folder)
    if found is not None:
        source, rows = found
        missing_files = []
        for number, row in enumerate(rows, 1):
            file_key = file_column or next((c for c in FILE_COLUMNS if c in row), None)
            if file_key is None or file_key not in row:
                wanted = file_column or " / ".join(FILE_COLUMNS)
                raise ValueError(
                    f"{source} row {number} has no file column `{wanted}` (path of the file relative to "
                    f"{folder}; set file_column)"
                )
            column = caption_column or next((c for c in CAPTION_COLUMNS if c in row), None)
            if column is None or column not in row:
                wanted = caption_column or " / ".join(CAPTION_COLUMNS)
                raise ValueError(f"{source} row {number} has no caption column `{wanted}` (set caption_column)")
            path = (folder / str(row[file_key])).resolve()
            if not path.is_file():
                missing_files.append(str(row[file_key]))
                continue
            captions[path] = str(row[column] or "").strip()
            if all(row.get(k) not in (None, "") for k in ("num_frames", "height", "width")):
                hints[path] = {k: int(row[k]) for k in ("num_frames", "height", "width")}
        if missing_files:
            raise FileNotFoundError(
                f"{source} lists {len(missing_files)} files that do not exist (e.g. {missing_files[:3]}); "
                f"fix the paths (relative to {folder}) or remove those rows"
            )
    for path in files:
        if captions.get(path.resolve()):
            continue
        sidecar = path.with_suffix(".txt")
        if sidecar.is_file():
            captions[path.resolve()] = sidecar.read_text().strip()
    out = {path: captions.get(path.resolve(), "") for path in files}
    missing = [str(p.relative_to(folder)) for p, c in out.items() if not c]
    if missing and found is None and (hint := datasets_root_hint(folder)):
        raise ValueError(hint)
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(files)} files in {folder} have no caption (e.g. {missing[:3]}): add a sidecar "
            "<name>.txt next to each file, or list the files in metadata.jsonl / metadata.csv with columns "
            "file_name and text"
        )
    return out, {path: hints[path.resolve()] for path in files if path.resolve() in hints}


def list_media(folder: Path) -> list[Path]:
    """Video and image files under ``folder`` (recursive, hidden folders skipped), sorted."""
    if not folder.is_dir():
        raise FileNotFoundError(f"data_dir {folder} does not exist or is not a folder")
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and is_media(p) and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if not files:
        raise ValueError(
            f"no videos or images found in {folder} "
            f"(looked for {', '.join(sorted({'.mp4', '.webm', '.mov', '.png', '.jpg'}))} ...)"
        )
    return files


def index_video_folder(
    folder: str | Path,
    resolution_buckets: list[tuple[int, int]],
    frame_buckets: list[int],
    frame_stride: int = 1,
    caption_column: str | None = None,
    rank: int = 0,
    world: int = 1,
    gather: Callable[[list], list] | None = None,
    file_column: str | None = None,
) -> tuple[list[VideoSample], DataReport]:
    """Index a caption folder into bucketed samples; corrupt and too-short files are skipped and reported.

    Cheap checks (files exist, every file has a caption) run before any file is probed. Probing is
    split across processes and gathered. Raises ``ValueError`` when nothing usable is left.
    """
    folder = Path(folder)
    files = list_media(folder)
    captions, hints = read_captions(folder, files, caption_column, file_column)
    to_probe = [p for p in files if p not in hints]
    probed = dict(zip(to_probe, probe_sharded(to_probe, rank, world, gather)))
    report = DataReport(found=len(files))
    samples = []
    for path in files:
        info = probed.get(path)
        if path in hints:
            h = hints[path]
            info = MediaInfo(h["num_frames"], h["height"], h["width"], path.suffix.lower() not in IMAGE_EXTENSIONS)
        key = str(path.relative_to(folder))
        if isinstance(info, str):
            report.corrupt.append(key)
            continue
        frames = 1 if not info.is_video else frame_bucket(info.num_frames, frame_stride, frame_buckets)
        if frames is None:
            report.too_short.append(key)
            continue
        height, width = nearest_resolution(info.height, info.width, resolution_buckets)
        samples.append(
            VideoSample(
                str(path), key, captions[path], info.num_frames, info.height, info.width, (frames, height, width)
            )
        )
    report.used = len(samples)
    if not samples:
        raise ValueError(f"no usable files in {folder}: {report.summary()}")
    return samples, report


class VideoTextDataset(Dataset):
    """Decoded, resized clips. Items are requested as ``(index, epoch)`` by :class:`BucketBatchSampler`.

    Returns ``{"pixels": (3, F, H, W) float in [-1, 1], "caption": str, "index": int}``.
    """

    def __init__(self, samples: list[VideoSample], frame_stride: int = 1, frame_sampling: str = "start", seed: int = 0):
        self.samples, self.stride, self.sampling, self.seed = samples, frame_stride, frame_sampling, seed
        self._by_bucket: dict[tuple, list[int]] = {}
        for index, sample in enumerate(samples):
            self._by_bucket.setdefault(sample.bucket, []).append(index)

    def __len__(self) -> int:
        return len(self.samples)

    def frame_indices(self, sample: VideoSample, epoch: int, index: int) -> list[int]:
        """Indices of the decoded frames: ``bucket frames`` frames ``stride`` apart."""
        count = sample.bucket[0]
        span = (count - 1) * self.stride + 1
        start = 0
        if self.sampling == "random" and sample.num_frames > span:
            start = sample_rng(self.seed, epoch, index).randint(0, sample.num_frames - span)
        return [start + i * self.stride for i in range(count)]

    def load(self, index: int, epoch: int) -> dict[str, Any]:
        sample = self.samples[index]
        frames_wanted, height, width = sample.bucket
        if Path(sample.path).suffix.lower() in IMAGE_EXTENSIONS:
            frames = read_image(sample.path)[None]
        else:
            frames = read_video_frames(sample.path, self.frame_indices(sample, epoch, index))
        return {"pixels": resize_center_crop(frames, height, width), "caption": sample.caption, "index": index}

    def __getitem__(self, item: tuple[int, int]) -> dict[str, Any]:
        index, epoch = item
        bucket = self._by_bucket[self.samples[index].bucket]
        return load_with_fallback(lambda i: self.load(i, epoch), index, bucket)


def collate_pixels(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack one bucket's clips: ``pixels`` ``(B, 3, F, H, W)``, ``captions``, ``indices`` ``(B,)``."""
    return {
        "pixels": torch.stack([item["pixels"] for item in items]),
        "captions": [item["caption"] for item in items],
        "indices": torch.tensor([item["index"] for item in items]),
    }


def latent_identity(sample: VideoSample) -> list:
    """What a cached latent depends on besides the cache settings: the file and its bucket."""
    return ["video", sample.key, list(sample.bucket)]


class CachedVideoDataset(Dataset):
    """Items from a :class:`~mhla_diffusion.finetune.latent_cache.LatentCache`:
    ``{"latents": (2C or C, f, h, w), "text": {"prompt_embeds": (L, D), ...}, "index": int}`` (``text``: the
    caption's cached text tensors, as :meth:`~mhla_diffusion.finetune.video_families.VideoRecipe.encode` made them)."""

    def __init__(self, cache, samples: list[VideoSample]) -> None:
        self.cache, self.samples = cache, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> dict[str, Any]:
        index, _ = item
        sample = self.samples[index]
        return {
            "latents": self.cache.read("latents", latent_identity(sample))["latents"],
            "text": self.cache.read("prompts", sample.caption),
            "index": index,
        }


def collate_cached_video(items: list[dict[str, Any]]) -> dict[str, Any]:
    """``latents`` ``(B, ...)``, ``text`` (a list of per-caption dicts of unpadded tensors), ``indices`` ``(B,)``."""
    return {
        "latents": torch.stack([item["latents"] for item in items]),
        "text": [item["text"] for item in items],
        "indices": torch.tensor([item["index"] for item in items]),
    }
