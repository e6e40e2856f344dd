"""Checks of the web demo's inputs, run before any model work.

Every problem is a :class:`DemoInputError` whose message is shown in the page as it is, so each one
says what was wrong and what is allowed. Nothing here imports Gradio or loads a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..pipelines.class_labels import resolve_class_ids
from ..utils.geometry import MAX_SEED, WAN_PIPELINE_SIZE_MULTIPLE, VideoGeometry
from ..utils.stream_frames import StreamChunks, stream_chunks

__all__ = [
    "DemoInputError",
    "ImageRequest",
    "Limits",
    "LongVideoRequest",
    "VideoBounds",
    "VideoRequest",
    "image_request",
    "long_video_request",
    "video_bounds",
    "video_request",
]


class DemoInputError(ValueError):
    """A bad value typed into the demo; the message is meant for the page."""


@dataclass(frozen=True)
class Limits:
    """What the demo accepts (bounds keep one request from exhausting the machine)."""

    max_steps: int = 100
    max_frames: int = 81
    #: Smallest height/width; ``None``: the model's own (one multiple of VAE scale x patch that ``WanPipeline`` takes).
    min_size: int | None = None
    max_size: int = 1024
    max_guidance: float = 20.0
    max_prompt_chars: int = 2000
    #: Samples per click (seeds ``seed``, ``seed + 1``, ...), per attention.
    max_samples: int = 8
    #: Frames of one streamed long video (its memory stays flat; its time grows with the length).
    max_long_frames: int = 1025


@dataclass(frozen=True)
class VideoBounds:
    """The video sizes the form offers for one model: the demo's :class:`Limits` within the model's own
    (its position table's largest clip, :meth:`~mhla_diffusion.utils.geometry.VideoGeometry.max_size`)."""

    max_frames: int
    min_height: int
    min_width: int
    max_height: int
    max_width: int


def video_bounds(geometry: VideoGeometry, limits: Limits = Limits()) -> VideoBounds:
    """The largest frame count and sizes (whole multiples) the form may offer for the model of ``geometry``."""
    largest = geometry.max_size() or (limits.max_frames, limits.max_size, limits.max_size)
    bounds = []
    for axis in (0, 1):
        multiple = geometry.generation_multiple[axis]
        bounds.append((limits.min_size or multiple, min(limits.max_size, largest[axis + 1]) // multiple * multiple))
    frames = min(limits.max_frames, largest[0])
    while frames > 1 and not geometry.valid_frames(frames):
        frames -= 1
    return VideoBounds(frames, bounds[0][0], bounds[1][0], bounds[0][1], bounds[1][1])


@dataclass(frozen=True)
class VideoRequest:
    """One checked text-to-video request."""

    prompt: str
    negative_prompt: str
    seed: int
    steps: int
    guidance_scale: float
    num_frames: int
    height: int
    width: int
    samples: int = 1

    @property
    def seeds(self) -> list[int]:
        """One seed per sample: ``seed``, ``seed + 1``, ..."""
        return list(range(self.seed, self.seed + self.samples))


@dataclass(frozen=True)
class ImageRequest:
    """One checked class-to-image request (``class_id`` resolved from a name or an id)."""

    class_label: str
    class_id: int
    seed: int
    steps: int
    guidance_scale: float
    samples: int = 1

    @property
    def seeds(self) -> list[int]:
        """One seed per sample: ``seed``, ``seed + 1``, ..."""
        return list(range(self.seed, self.seed + self.samples))


@dataclass(frozen=True)
class LongVideoRequest:
    """One checked long-video request: a single video of ``num_frames`` frames, streamed as ``chunks``."""

    prompt: str
    negative_prompt: str
    seed: int
    steps: int
    guidance_scale: float
    num_frames: int
    height: int
    width: int
    chunks: StreamChunks


def _integer(value: Any, name: str) -> int:
    """``value`` as an int; ``None``, text and fractional numbers are errors."""
    if isinstance(value, bool) or value is None or value == "":
        raise DemoInputError(f"{name} is missing: enter a whole number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DemoInputError(f"{name} must be a whole number, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise DemoInputError(f"{name} must be a whole number, got {value!r}")
    return int(number)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or value is None or value == "":
        raise DemoInputError(f"{name} is missing: enter a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DemoInputError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise DemoInputError(f"{name} must be a finite number, got {value!r}")
    return number


def _in_range(value: float, low: float, high: float, name: str) -> None:
    def text(number: float) -> str:  # whole numbers in full (seeds: 4294967295, not 4.29497e+09)
        return str(number) if isinstance(number, int) else f"{number:g}"

    if not low <= value <= high:
        raise DemoInputError(f"{name} {text(value)} is out of range: use {text(low)} to {text(high)}")


def _common(seed: Any, steps: Any, guidance: Any, samples: Any, limits: Limits) -> tuple[int, int, float, int]:
    seed_value = _integer(seed, "Seed")
    _in_range(seed_value, 0, MAX_SEED, "Seed")
    step_count = _integer(steps, "Steps")
    _in_range(step_count, 1, limits.max_steps, "Steps")
    scale = _number(guidance, "Guidance scale")
    _in_range(scale, 0.0, limits.max_guidance, "Guidance scale")
    count = _integer(samples, "Samples")
    _in_range(count, 1, limits.max_samples, "Samples")
    if seed_value + count - 1 > MAX_SEED:
        raise DemoInputError(
            f"Seed {seed_value} with {count} samples needs seeds up to {seed_value + count - 1}: "
            f"the last seed may be at most {MAX_SEED}"
        )
    return seed_value, step_count, scale, count


def _prompts(prompt: Any, negative_prompt: Any, limits: Limits) -> tuple[str, str]:
    """The prompt (not empty, not too long) and the negative prompt, stripped."""
    text = (prompt or "").strip() if isinstance(prompt, str) or prompt is None else str(prompt).strip()
    if not text:
        raise DemoInputError("The prompt is empty: describe the video to generate")
    if len(text) > limits.max_prompt_chars:
        raise DemoInputError(f"The prompt is too long ({len(text)} characters; at most {limits.max_prompt_chars})")
    return text, "" if negative_prompt is None else str(negative_prompt).strip()


def _video_size(height: Any, width: Any, limits: Limits, geometry: VideoGeometry) -> tuple[int, int]:
    """Height and width as whole multiples the model takes, within the demo's bounds."""
    sizes = []
    for axis, (name, value) in enumerate((("Height", height), ("Width", width))):
        size = _integer(value, name)
        multiple = geometry.generation_multiple[axis]
        if size % multiple:
            raise DemoInputError(
                f"{name} {size} is not supported: use a multiple of {multiple} ({_size_rule(geometry, axis)})"
            )
        _in_range(size, limits.min_size or multiple, limits.max_size, name)
        sizes.append(size)
    return sizes[0], sizes[1]


def _model_size(geometry: VideoGeometry, num_frames: int, height: int, width: int) -> None:
    """The position encoding's bounds on a clip of ``num_frames`` frames (the message capitalised for the page)."""
    try:
        geometry.check_size(num_frames, height, width, generation=True)
    except ValueError as error:
        message = str(error)
        raise DemoInputError(message[:1].upper() + message[1:]) from None


def video_request(
    prompt: Any,
    negative_prompt: Any,
    seed: Any,
    steps: Any,
    guidance: Any,
    num_frames: Any,
    height: Any,
    width: Any,
    limits: Limits = Limits(),
    geometry: VideoGeometry = VideoGeometry(),
    samples: Any = 1,
) -> VideoRequest:
    """Check the text-to-video inputs; raise :class:`DemoInputError` on the first problem.

    Frame counts and sizes are judged by ``geometry``, the model's size rules (default: Wan2.1's;
    ``VideoGeometry.from_folder(model)`` for another model), as a Diffusers ``WanPipeline`` takes them.
    """
    text, negative = _prompts(prompt, negative_prompt, limits)
    seed_value, step_count, scale, count = _common(seed, steps, guidance, samples, limits)
    frames = _integer(num_frames, "Frames")
    if not geometry.valid_frames(frames):
        examples = ", ".join(map(str, geometry.example_frames(5)))
        raise DemoInputError(
            f"Frames {frames} is not supported: use {geometry.frame_rule(examples=False)} frames "
            f"({examples}, ...; {geometry.describe()})"
        )
    if frames > limits.max_frames:
        raise DemoInputError(f"Frames {frames} is too many: at most {limits.max_frames}")
    size = _video_size(height, width, limits, geometry)
    _model_size(geometry, frames, *size)
    return VideoRequest(text, negative, seed_value, step_count, scale, frames, *size, count)


def long_video_request(
    prompt: Any,
    negative_prompt: Any,
    seed: Any,
    steps: Any,
    guidance: Any,
    num_frames: Any,
    height: Any,
    width: Any,
    limits: Limits = Limits(),
    geometry: VideoGeometry = VideoGeometry(),
    chunk_frames: int | None = None,
) -> LongVideoRequest:
    """Check the long-video inputs; raise :class:`DemoInputError` on the first problem.

    The frame count follows the chunk rule of a stream (:func:`~mhla_diffusion.utils.stream_frames.stream_chunks`,
    with ``geometry``'s VAE time factor and the model's ``chunk_frames``, ``None``: the rule's default): any
    length, not bounded by the position table, which bounds only the frame size and a chunk's frames.
    """
    text, negative = _prompts(prompt, negative_prompt, limits)
    seed_value, step_count, scale, _ = _common(seed, steps, guidance, 1, limits)
    frames = _integer(num_frames, "Frames")
    _in_range(frames, 1, limits.max_long_frames, "Frames")
    try:
        chunks = stream_chunks(frames, chunk_frames, geometry.vae_scale_temporal, geometry.patch_size[0])
    except ValueError as error:  # "<n> frames do not stream in chunks of ...: <the rule>; nearest: <counts>"
        rule = str(error).split(": ", 1)[-1]
        raise DemoInputError(f"Frames {frames} is not supported: {rule}") from None
    size = _video_size(height, width, limits, geometry)
    _model_size(geometry, chunks.video_frames(0), *size)
    return LongVideoRequest(text, negative, seed_value, step_count, scale, frames, *size, chunks)


def _size_rule(geometry: VideoGeometry, axis: int) -> str:
    """Why heights (``axis`` 0) or widths (1) must be multiples of what they must: the model's factors."""
    rule = f"VAE x{geometry.vae_scale_spatial} in space, patch {geometry.patch_size[axis + 1]}"
    if geometry.generation_multiple[axis] != geometry.size_multiple[axis]:
        rule += (
            f": {geometry.size_multiple[axis]}; Diffusers' WanPipeline needs multiples of {WAN_PIPELINE_SIZE_MULTIPLE}"
        )
    return rule


def image_request(
    class_label: Any,
    seed: Any,
    steps: Any,
    guidance: Any,
    labels: dict[str, int],
    num_classes: int,
    limits: Limits = Limits(),
    samples: Any = 1,
) -> ImageRequest:
    """Check the class-to-image inputs; ``class_label`` is a name from ``labels`` or an id below ``num_classes``."""
    label = "" if class_label is None else str(class_label).strip()
    if not label:
        raise DemoInputError("No class given: choose a class name or type a class id")
    try:
        (class_id,) = resolve_class_ids([label], labels, num_classes)
    except ValueError:
        examples = ", ".join(list(labels)[:5])
        raise DemoInputError(
            f"Unknown class {label!r}: choose a listed class name or an id from 0 to {num_classes - 1}"
            + (f" (names such as {examples})" if examples else "")
        ) from None
    seed_value, step_count, scale, count = _common(seed, steps, guidance, samples, limits)
    return ImageRequest(label, class_id, seed_value, step_count, scale, count)
