"""What a model generates by default (size, frames, steps, guidance, frame rate, text length), read from the model.

The command line and the web demo fill every setting the user leaves out from here, so a model is
run at the size it was made for, not at Wan2.1-T2V-1.3B's 81x480x832 whatever it is. Each value
comes from the first of these that has it:

1. **the pipeline folder's own record**: the ``_mhla_generation_defaults`` entry of its
   ``model_index.json`` (:data:`RECORD_KEY`), e.g. ``{"num_frames": 17, "height": 64, "width": 64,
   "num_inference_steps": 20, "guidance_scale": 5.0, "fps": 8, "max_sequence_length": 16}``
   (video) or ``{"num_inference_steps": 25, "guidance_scale": 4.0}`` (class-to-image); any subset. The
   trainers' ``save_pipeline`` writes the settings a run trained with (``record_generation_defaults`` of
   :class:`~mhla_diffusion.pipelines.mhla_mixin.MHLAPipelineMixin`);
2. **an embedded demonstration model** (:func:`mhla_diffusion.embedded.locations.embedded_folder`):
   the settings ``mhla build-embedded`` trains it with (:class:`~mhla_diffusion.embedded.locations.EmbeddedDefaults`,
   which the build reads too);
3. **a published Wan model**, recognised by its name in the hub id or folder name (``Wan2.2-TI2V-5B``)
   or, for a local folder, by its transformer config (:mod:`mhla_diffusion.utils.wan_configs`): its
   published frames, size and frame rate (:data:`PUBLISHED_WAN_SIZES`);
4. **Diffusers' pipeline defaults** for what is left: 50 steps, guidance 5.0 (``WanPipeline``) or
   4.0 (``DiTPipeline``), 512 text tokens, 16 fps. No size: a model none of the above describes has
   no default size (:attr:`VideoDefaults.missing_size`), and the caller asks the user for one.

Nothing here imports torch; only JSON files are read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..embedded.locations import embedded_defaults, embedded_folder
from .geometry import read_component_config
from .wan_configs import WAN_TRANSFORMER_CONFIGS

__all__ = [
    "PUBLISHED_WAN_SIZES",
    "RECORD_KEY",
    "ImageDefaults",
    "VideoDefaults",
    "checked_record",
    "image_defaults",
    "published_wan_model",
    "video_defaults",
]

#: The ``model_index.json`` entry that records a pipeline folder's generation defaults.
RECORD_KEY = "_mhla_generation_defaults"

#: (frames, height, width, fps) each published Wan model is run at on its model card (the 720p setting
#: where a model has two; Wan2.2-TI2V-5B: 121 frames of 704x1280 at 24 fps).
PUBLISHED_WAN_SIZES: dict[str, tuple[int, int, int, int]] = {
    "Wan2.1-T2V-1.3B": (81, 480, 832, 16),
    "Wan2.1-T2V-14B": (81, 720, 1280, 16),
    "Wan2.1-I2V-14B-480P": (81, 480, 832, 16),
    "Wan2.1-I2V-14B-720P": (81, 720, 1280, 16),
    "Wan2.1-FLF2V-14B-720P": (81, 720, 1280, 16),
    "Wan2.2-T2V-A14B": (81, 720, 1280, 16),
    "Wan2.2-I2V-A14B": (81, 720, 1280, 16),
    "Wan2.2-TI2V-5B": (121, 704, 1280, 24),
}
#: Transformer config entries that tell the published Wan models apart (with ``transformer_2``'s presence).
_IDENTIFYING = (
    "num_attention_heads",
    "attention_head_dim",
    "num_layers",
    "ffn_dim",
    "in_channels",
    "out_channels",
    "image_dim",
    "added_kv_proj_dim",
    "pos_embed_seq_len",
)
_TWO_TRANSFORMERS = {"Wan2.2-T2V-A14B", "Wan2.2-I2V-A14B"}
#: Record keys and the type each must have (``num_inference_steps`` is ``steps`` here).
_VIDEO_KEYS = {
    "num_frames": int,
    "height": int,
    "width": int,
    "num_inference_steps": int,
    "guidance_scale": float,
    "fps": int,
    "max_sequence_length": int,
    "chunk_frames": int,  # a block-causal model: the latent frames per chunk it streams (and trained) with
    "first_chunk_frames": int,  # ... and of its first chunk, when that differs
    "context_noise": float,  # ... and the noise level its stream gives each finished chunk as context
}
_IMAGE_KEYS = {"num_inference_steps": int, "guidance_scale": float}


@dataclass(frozen=True)
class VideoDefaults:
    """A video model's defaults; ``None`` sizes: the model says nothing about its size.

    ``source`` names where the size came from (for messages), e.g. ``"the embedded model's training settings"``.
    """

    num_frames: int | None
    height: int | None
    width: int | None
    steps: int
    guidance_scale: float
    fps: int
    max_sequence_length: int
    source: str
    chunk_frames: int | None = None  # streaming: latent frames per chunk (None: the chunk rule's default)
    first_chunk_frames: int | None = None  # streaming: latent frames of the first chunk (None: chunk_frames)

    @property
    def missing_size(self) -> list[str]:
        """The size settings this model has no default for (``["num_frames", "height", "width"]`` or a part)."""
        return [name for name in ("num_frames", "height", "width") if getattr(self, name) is None]


@dataclass(frozen=True)
class ImageDefaults:
    """A class-to-image model's defaults (its image size is the transformer's ``sample_size``, not a choice)."""

    steps: int
    guidance_scale: float
    source: str


def checked_record(record: Any, video: bool, where: str) -> dict[str, Any]:
    """A ``_mhla_generation_defaults`` record checked and typed (``video``: a Wan pipeline's keys, else DiT's);
    a ``ValueError`` names ``where`` it came from and the bad setting."""
    keys = _VIDEO_KEYS if video else _IMAGE_KEYS
    if not isinstance(record, dict):
        raise ValueError(f"{where}: {RECORD_KEY} must be an object of settings, got {record!r}")
    unknown = sorted(set(record) - set(keys))
    if unknown:
        raise ValueError(f"{where}: {RECORD_KEY} has unknown settings {unknown}; known: {', '.join(keys)}")
    for name, value in record.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        whole = number and keys[name] is int and float(value).is_integer() and value >= 1
        finite = number and keys[name] is float and math.isfinite(value) and value >= 0
        if not (whole or finite):
            what = "a whole number >= 1" if keys[name] is int else "a finite number >= 0"
            raise ValueError(f"{where}: {RECORD_KEY}.{name} must be {what}, got {value!r}")
    return {name: keys[name](value) for name, value in record.items()}


def _read_record(model: str | os.PathLike, video: bool) -> dict[str, Any]:
    """The checked ``_mhla_generation_defaults`` record of a local pipeline folder (``{}`` when it has none)."""
    index = Path(model, "model_index.json")
    try:
        record = json.loads(index.read_text()).get(RECORD_KEY)
    except (OSError, ValueError, AttributeError):
        return {}
    return {} if record is None else checked_record(record, video, str(index))


def _model_name_in(text: str) -> str | None:
    """The published Wan model whose name ``text`` (a hub id or a folder name) contains; the longest such name."""
    lowered = text.lower()
    found = [name for name in PUBLISHED_WAN_SIZES if name.lower() in lowered]
    return max(found, key=len) if found else None


def published_wan_model(model: str | os.PathLike) -> str | None:
    """The published Wan model ``model`` is (e.g. ``"Wan2.2-TI2V-5B"``), or ``None``.

    A hub id or folder whose name contains a published model's name is that model; otherwise a local
    folder whose transformer config matches exactly one published config (its heads, layers, widths, input
    channels and image inputs, and whether it has a ``transformer_2``). Models with equal configs and
    different published sizes (Wan2.1-I2V-14B 480P and 720P) are not told apart by config: ``None``.
    """
    named = _model_name_in(str(model)) or _model_name_in(Path(model).resolve().name if os.path.isdir(model) else "")
    if named is not None:
        return named
    config = read_component_config(model, "transformer")
    if config is None:
        return None
    two = read_component_config(model, "transformer_2") is not None
    matches = [
        name
        for name, published in WAN_TRANSFORMER_CONFIGS.items()
        if all(config.get(key) == published.get(key) for key in _IDENTIFYING) and (name in _TWO_TRANSFORMERS) == two
    ]
    sizes = {PUBLISHED_WAN_SIZES[name] for name in matches}
    return matches[0] if len(sizes) == 1 else None


def video_defaults(model: str | os.PathLike) -> VideoDefaults:
    """The defaults of the Wan video pipeline ``model`` (a folder or a hub id); see the module docstring."""
    record = _read_record(model, video=True) if os.path.isdir(model) else {}
    values: dict[str, Any] = {"num_inference_steps": 50, "guidance_scale": 5.0, "fps": 16, "max_sequence_length": 512}
    source = "nothing: the model records no size"
    if embedded_folder(model) is not None:
        d = embedded_defaults()
        values.update(
            num_frames=d.num_frames,
            height=d.height,
            width=d.width,
            num_inference_steps=d.video_steps,
            guidance_scale=d.video_guidance_scale,
            fps=d.fps,
            max_sequence_length=d.max_sequence_length,
        )
        source = "the embedded model's training settings"
    else:
        name = published_wan_model(model)
        if name is not None:
            frames, height, width, fps = PUBLISHED_WAN_SIZES[name]
            values.update(num_frames=frames, height=height, width=width, fps=fps)
            source = f"{name}'s published size"
    if record:
        values.update(record)
        if set(record) & {"num_frames", "height", "width"}:
            source = f"{RECORD_KEY} in {Path(model, 'model_index.json')}"
    return VideoDefaults(
        values.get("num_frames"),
        values.get("height"),
        values.get("width"),
        values["num_inference_steps"],
        values["guidance_scale"],
        values["fps"],
        values["max_sequence_length"],
        source,
        values.get("chunk_frames"),
        values.get("first_chunk_frames"),
    )


def image_defaults(model: str | os.PathLike) -> ImageDefaults:
    """The defaults of the DiT class-to-image pipeline ``model`` (a folder or a hub id); see the module docstring."""
    record = _read_record(model, video=False) if os.path.isdir(model) else {}
    values: dict[str, Any] = {"num_inference_steps": 50, "guidance_scale": 4.0}
    source = "DiTPipeline's defaults"
    if embedded_folder(model) is not None:
        d = embedded_defaults()
        values.update(num_inference_steps=d.image_steps, guidance_scale=d.image_guidance_scale)
        source = "the embedded model's training settings"
    if record:
        values.update(record)
        source = f"{RECORD_KEY} in {Path(model, 'model_index.json')}"
    return ImageDefaults(values["num_inference_steps"], values["guidance_scale"], source)
