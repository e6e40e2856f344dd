"""Class-to-image data: an image folder with one sub-folder per class (``root/<class>/<image>``).

Class ids: ``class_map`` (folder name -> id) when given; otherwise numeric folder names are their
own ids, and any other names are numbered in sorted order (ImageNet's synset folders -> 0..999).
Images are ADM centre-cropped to a square and optionally flipped: a per-sample coin per epoch, or
(``flip_coin_per_batch``, DiT's released recipe) one coin per batch, thrown by the trainer with the
step's generator (:func:`flip_coin`, :func:`batch_view`): the datasets then hand out un-flipped
pixels, or both cached views.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from .data import DataReport, datasets_root_hint, load_with_fallback, probe_sharded, sample_rng
from .media import IMAGE_EXTENSIONS, adm_center_crop, probe, read_image

__all__ = [
    "CachedImageDataset",
    "ClassImageDataset",
    "ImageSample",
    "batch_view",
    "class_ids_for",
    "collate_cached_images",
    "collate_images",
    "count_classes",
    "flip_coin",
    "index_class_folder",
    "latent_identity",
]


@dataclass(frozen=True)
class ImageSample:
    path: str
    key: str  # path relative to the data folder
    label: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ImageSample":
        return cls(**data)


def class_ids_for(names: list[str], class_map: dict | None, num_classes: int) -> dict[str, int]:
    """Class id of every class folder name; ids must lie in ``0..num_classes-1``."""
    if class_map is not None:
        unknown = sorted(set(names) - set(map(str, class_map)))
        if unknown:
            raise ValueError(f"class folders {unknown[:5]} are not in `class_map`; add them or remove the folders")
        ids = {name: int(class_map[name]) for name in names}
    elif all(name.isdigit() for name in names):
        ids = {name: int(name) for name in names}
    else:
        ids = {name: i for i, name in enumerate(sorted(names))}
    bad = sorted(name for name, i in ids.items() if not 0 <= i < num_classes)
    if bad:
        raise ValueError(f"class folders {bad[:5]} map to ids outside 0..{num_classes - 1} (the model's classes)")
    return ids


def _class_folders(folder: str | Path) -> tuple[Path, list[str]]:
    """``folder`` and the names of its class sub-folders (sorted), or a clear error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"data_dir {folder} does not exist or is not a folder")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if hint := datasets_root_hint(folder):
        raise ValueError(hint)
    if not classes:
        raise ValueError(f"{folder} has no class sub-folders: put the images of each class in {folder}/<class name>/")
    return folder, classes


def count_classes(folder: str | Path, class_map: dict | None = None) -> int:
    """How many classes the class folders of ``folder`` need: the largest class id + 1."""
    folder, classes = _class_folders(folder)
    return max(class_ids_for(classes, class_map, num_classes=2**62).values()) + 1


def index_class_folder(
    folder: str | Path,
    num_classes: int,
    class_map: dict | None = None,
    rank: int = 0,
    world: int = 1,
    gather: Callable[[list], list] | None = None,
) -> tuple[list[ImageSample], DataReport, dict[str, int]]:
    """Index ``folder/<class>/*.png|jpg|...``; unreadable images are skipped and reported.

    Returns samples, the report and ``{class folder: id}``.
    """
    folder, classes = _class_folders(folder)
    ids = class_ids_for(classes, class_map, num_classes)
    files = [
        (path, ids[name])
        for name in classes
        for path in sorted((folder / name).rglob("*"))
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS
    ]
    if not files:
        raise ValueError(f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in the class folders of {folder}")
    checked = probe_sharded([p for p, _ in files], rank, world, gather, check=probe)
    report = DataReport(found=len(files))
    samples = []
    for (path, label), result in zip(files, checked):
        key = str(path.relative_to(folder))
        if isinstance(result, str):
            report.corrupt.append(key)
        else:
            samples.append(ImageSample(str(path), key, label))
    report.used = len(samples)
    if not samples:
        raise ValueError(f"no usable images in {folder}: {report.summary()}")
    return samples, report, ids


class ClassImageDataset(Dataset):
    """ADM-cropped images as ``{"pixels": (3, R, R) in [-1, 1], "label": int, "index": int}``."""

    def __init__(self, samples: list[ImageSample], resolution: int, random_flip: bool = True, seed: int = 0):
        self.samples, self.resolution, self.random_flip, self.seed = samples, resolution, random_flip, seed
        self._all = list(range(len(samples)))

    def __len__(self) -> int:
        return len(self.samples)

    def flipped(self, epoch: int, index: int) -> bool:
        return self.random_flip and sample_rng(self.seed, epoch, index).random() < 0.5

    def load(self, index: int, epoch: int) -> dict[str, Any]:
        sample = self.samples[index]
        image = adm_center_crop(read_image(sample.path), self.resolution)
        if self.flipped(epoch, index):
            image = image[:, ::-1]
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 127.5 - 1.0  # a writable copy
        return {"pixels": pixels, "label": sample.label, "index": index}

    def __getitem__(self, item: tuple[int, int]) -> dict[str, Any]:
        index, epoch = item
        return load_with_fallback(lambda i: self.load(i, epoch), index, self._all)


def collate_images(items: list[dict[str, Any]]) -> dict[str, Any]:
    """``pixels`` ``(B, 3, R, R)``, ``labels`` ``(B,)``, ``indices`` ``(B,)``."""
    return {
        "pixels": torch.stack([item["pixels"] for item in items]),
        "labels": torch.tensor([item["label"] for item in items]),
        "indices": torch.tensor([item["index"] for item in items]),
    }


def latent_identity(sample: ImageSample) -> list:
    return ["image", sample.key]


class CachedImageDataset(Dataset):
    """Items from a latent cache: ``{"latents": (2C or C, h, w), "label": int, "index": int}``; the
    flipped image's latents when this epoch's coin (the same as :class:`ClassImageDataset`'s) says so.
    With ``both_views`` (a coin per batch, thrown later), no coin: ``latents`` and ``latents_flipped``."""

    def __init__(
        self, cache, samples: list[ImageSample], random_flip: bool = True, seed: int = 0, both_views: bool = False
    ) -> None:
        self.cache, self.samples, self.both_views = cache, samples, both_views
        self._coins = ClassImageDataset(samples, resolution=1, random_flip=random_flip and not both_views, seed=seed)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> dict[str, Any]:
        index, epoch = item
        sample = self.samples[index]
        entry = self.cache.read("latents", latent_identity(sample))
        if self.both_views:
            return {
                "latents": entry["latents"],
                "latents_flipped": entry["latents_flipped"],
                "label": sample.label,
                "index": index,
            }
        key = "latents_flipped" if self._coins.flipped(epoch, index) else "latents"
        return {"latents": entry[key], "label": sample.label, "index": index}


def collate_cached_images(items: list[dict[str, Any]]) -> dict[str, Any]:
    """``latents`` (and ``latents_flipped`` when the items hold both views) ``(B, ...)``, ``labels``, ``indices``."""
    views = [key for key in ("latents", "latents_flipped") if key in items[0]]
    return {
        **{key: torch.stack([item[key] for item in items]) for key in views},
        "labels": torch.tensor([item["label"] for item in items]),
        "indices": torch.tensor([item["index"] for item in items]),
    }


def flip_coin(generator: torch.Generator) -> bool:
    """One fair coin from the step's generator: flip the whole batch or none of it."""
    return bool(torch.rand((), generator=generator, device=generator.device) < 0.5)


def batch_view(batch: dict[str, Any], flipped: bool) -> dict[str, Any]:
    """``batch`` with every image flipped or none: the cached ``latents_flipped`` or ``latents``, or the
    pixels mirrored left-right (``(B, 3, H, W)``)."""
    out = {k: v for k, v in batch.items() if k != "latents_flipped"}
    if "latents" in batch:
        out["latents"] = batch["latents_flipped"] if flipped else batch["latents"]
    elif flipped:
        out["pixels"] = batch["pixels"].flip(-1)
    return out
