"""Class-to-image samples for evaluation, across processes, resumable, packed into an ADM ``.npz``.

Works with any pipeline called like Diffusers' ``DiTPipeline``:
``pipe(class_labels=[...], guidance_scale=..., generator=[...], num_inference_steps=..., output_type="np")``.

* Sample ``i`` has its own initial-noise generator seeded from ``(seed, i)`` and its class label
  from a seeded label table (``uniform``: i.i.d. uniform classes; ``balanced``: N/K per class,
  shuffled), so a sample does not depend on the number of processes or on what was generated before.
* Process ``r`` of ``P`` owns samples ``r, r + P, r + 2P, ...`` and skips those already on disk
  (``{i:06d}.png``, written atomically), so a killed run is resumed by running it again.
* ``sampling.json`` in the folder records the settings; a rerun with other settings is refused.
* :func:`pack_samples` streams the PNGs into ``arr_0`` (uint8 NHWC) with the labels as ``arr_1``.

The pipeline is loaded with :func:`mhla_diffusion.loaders.loading.load_pipeline` (``mhla eval-sample``).

Pixel rounding follows DiT's ``sample_ddp.py``: ``uint8(clip(floor(255 x + 0.5)))`` for ``x`` in [0, 1].
Schedulers that add noise in their steps (DDPM) draw it from the global torch RNG, seeded per batch
from its first sample: such samples depend on the batching; DDIM-style schedulers do not.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from ..pipelines.outputs import float_to_uint8
from .npz import AdmNpzWriter

__all__ = [
    "MANIFEST_NAME",
    "SamplingConfig",
    "class_labels",
    "num_classes_of",
    "process_state",
    "pack_samples",
    "sample_for_evaluation",
    "sample_path",
    "sample_seed",
    "shard_indices",
    "to_uint8",
]

MANIFEST_NAME = "sampling.json"
_FORMAT = "mhla-eval-samples"
CLASS_MODES = ("uniform", "balanced")


@dataclass(frozen=True)
class SamplingConfig:
    """What the samples in a folder are: everything that changes a sample's pixels."""

    num_samples: int
    num_classes: int
    class_mode: str = "uniform"
    seed: int = 0
    num_inference_steps: int = 250
    guidance_scale: float = 1.5
    pipeline: str = ""
    mhla_weights: str | None = None

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.class_mode not in CLASS_MODES:
            raise ValueError(f"class_mode must be one of {CLASS_MODES}, got {self.class_mode!r}")
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")

    def manifest(self) -> dict[str, Any]:
        return {"format": _FORMAT, **asdict(self)}


def class_labels(num_samples: int, num_classes: int, mode: str = "uniform", seed: int = 0) -> np.ndarray:
    """Labels ``(num_samples,)`` int64: i.i.d. uniform, or balanced (each class N/K times, +-1) and shuffled."""
    if mode == "uniform":
        return np.random.default_rng([seed, 1]).integers(0, num_classes, size=num_samples, dtype=np.int64)
    if mode == "balanced":
        return np.random.default_rng([seed, 2]).permutation(np.arange(num_samples, dtype=np.int64) % num_classes)
    raise ValueError(f"class mode must be one of {CLASS_MODES}, got {mode!r}")


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index``'s noise generator: a hash of ``(seed, index)`` (no collisions across seeds)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def shard_indices(num_samples: int, process_index: int, num_processes: int) -> range:
    """The sample indices process ``process_index`` of ``num_processes`` owns."""
    return range(process_index, num_samples, num_processes)


def sample_path(folder: str | os.PathLike, index: int, num_samples: int) -> Path:
    """``folder / 000123.png`` (at least 6 digits, more for more samples)."""
    return Path(folder) / f"{index:0{max(6, len(str(num_samples - 1)))}d}.png"


def to_uint8(images: Any) -> np.ndarray:
    """Pipeline output -> uint8 ``(n, H, W, 3)``: float arrays in [0, 1] (NHWC) or a list of PIL images."""
    if isinstance(images, (list, tuple)) and images and isinstance(images[0], Image.Image):
        return np.stack([np.asarray(im.convert("RGB")) for im in images])
    if torch.is_tensor(images):  # output_type="pt": (n, 3, H, W)
        images = images.permute(0, 2, 3, 1).float().cpu().numpy()
    return float_to_uint8(np.asarray(images))


def _write_png(path: Path, image: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    Image.fromarray(image).save(tmp, format="PNG")
    os.replace(tmp, path)  # a killed run never leaves a half-written sample under the final name


def _check_manifest(folder: Path, config: SamplingConfig, is_main: bool) -> None:
    path = folder / MANIFEST_NAME
    wanted = config.manifest()
    if path.exists():
        found = json.loads(path.read_text())
        diff = {k: (found.get(k), v) for k, v in wanted.items() if found.get(k) != v}
        if diff:
            listed = "; ".join(f"{k}: folder has {a!r}, asked {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{folder} holds samples made with other settings ({listed}); "
                "use another output folder, or the same settings to resume"
            )
    elif is_main:
        tmp = path.with_name(f".{MANIFEST_NAME}.tmp")
        tmp.write_text(json.dumps(wanted, indent=2) + "\n")
        os.replace(tmp, path)


def process_state() -> Any:
    """accelerate's ``PartialState``; on a machine without CUDA, its multi-CPU (gloo) mode under ``torchrun``."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def sample_for_evaluation(
    pipe: Any,
    folder: str | os.PathLike,
    config: SamplingConfig,
    *,
    batch_size: int = 16,
    state: Any = None,
    progress: bool = True,
) -> dict[str, int]:
    """Generate this process's missing samples of ``config`` into ``folder``; return counts.

    Args:
        pipe: a DiT-style pipeline (already on its device; moved to ``state.device`` if that is set).
        folder: where ``{i:06d}.png`` and ``sampling.json`` go.
        config: the samples to make.
        batch_size: samples per pipeline call.
        state: an ``accelerate.PartialState`` (the default; one process without ``accelerate launch``)
            or anything with ``process_index``, ``num_processes``, ``is_main_process``, ``device``
            and ``wait_for_everyone()``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if state is None:
        state = process_state()
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    _check_manifest(folder, config, state.is_main_process)
    labels = class_labels(config.num_samples, config.num_classes, config.class_mode, config.seed)
    owned = shard_indices(config.num_samples, state.process_index, state.num_processes)
    todo = [i for i in owned if not sample_path(folder, i, config.num_samples).exists()]
    if state.device is not None:
        pipe = pipe.to(state.device)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    batches = [todo[s : s + batch_size] for s in range(0, len(todo), batch_size)]
    for batch in tqdm(
        batches,
        desc=f"sampling (process {state.process_index})",
        unit="batch",
        disable=not (progress and state.is_main_process),
    ):
        generators = [torch.Generator("cpu").manual_seed(sample_seed(config.seed, i)) for i in batch]
        torch.manual_seed(sample_seed(config.seed, batch[0]))
        with torch.inference_mode():
            output = pipe(
                class_labels=labels[batch].tolist(),
                guidance_scale=config.guidance_scale,
                generator=generators,
                num_inference_steps=config.num_inference_steps,
                output_type="np",
            )
        images = to_uint8(output.images if hasattr(output, "images") else output[0])
        if images.shape[0] != len(batch) or images.ndim != 4 or images.shape[3] != 3:
            raise ValueError(
                f"the pipeline returned images of shape {images.shape} for {len(batch)} labels; expected (n, H, W, 3)"
            )
        for index, image in zip(batch, images):
            _write_png(sample_path(folder, index, config.num_samples), image)
    state.wait_for_everyone()
    return {"owned": len(owned), "existing": len(owned) - len(todo), "generated": len(todo)}


def pack_samples(
    folder: str | os.PathLike, output: str | os.PathLike | None = None, overwrite: bool = False, progress: bool = True
) -> Path:
    """Stream all samples of ``folder`` (in index order) into an ADM ``.npz`` (``arr_0`` images, ``arr_1`` labels).

    ``output`` defaults to ``<folder>.npz`` next to the folder. Every sample must be present.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} not found: {folder} was not written by sample_for_evaluation")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != _FORMAT:
        raise ValueError(f"{manifest_path} is not a sampling manifest of this tool (format {manifest.get('format')!r})")
    config = SamplingConfig(**{k: v for k, v in manifest.items() if k != "format"})
    output = Path(output) if output is not None else folder.with_name(folder.name + ".npz")
    paths = [sample_path(folder, i, config.num_samples) for i in range(config.num_samples)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise ValueError(
            f"{len(missing)} of {config.num_samples} samples are missing in {folder} "
            f"(e.g. {', '.join(missing[:5])}); run the sampler again to finish them"
        )
    with Image.open(paths[0]) as first:
        size = (first.height, first.width)
    with AdmNpzWriter(output, overwrite=overwrite) as writer:
        writer.begin_images(config.num_samples, size)
        for path in tqdm(paths, desc="packing", unit="image", disable=not progress):
            with Image.open(path) as image:
                writer.write_images(np.asarray(image.convert("RGB"))[None])
        writer.add_array("arr_1", class_labels(config.num_samples, config.num_classes, config.class_mode, config.seed))
    return output


def num_classes_of(pipe: Any) -> int:
    """Class count of a DiT-style pipeline: ``transformer.config.num_embeds_ada_norm`` (1000 for ImageNet)."""
    value = getattr(getattr(getattr(pipe, "transformer", None), "config", None), "num_embeds_ada_norm", None)
    if not isinstance(value, int) or value < 1:
        raise ValueError("cannot tell the number of classes from the pipeline's transformer; pass --num-classes")
    return value
