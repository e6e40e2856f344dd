"""Procedural "moving shapes" videos: one coloured shape sliding across a plain dark background.

3 shapes x 4 colours x 4 directions = 48 prompts ("a red circle moving left"). Every clip is
``NUM_FRAMES`` frames of ``FRAME_SIZE`` x ``FRAME_SIZE`` RGB, and is a pure function of
``(seed, k)``: its attributes, position, size and speed never depend on the dataset size.

Shapes are drawn with hard edges, so a clip holds exactly two colours (background and shape) and
survives lossless palette formats such as GIF bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ATTRIBUTES",
    "BACKGROUND",
    "COLOURS",
    "DIRECTIONS",
    "FRAME_SIZE",
    "NUM_COMBINATIONS",
    "NUM_FRAMES",
    "SHAPES",
    "ShapeClip",
    "caption_for",
    "generate_clips",
    "parse_caption",
    "render_clip",
    "shape_clip",
]

NUM_FRAMES = 9
FRAME_SIZE = 48
BACKGROUND = (16, 16, 16)
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240), "yellow": (240, 220, 40)}
# (dx, dy) per frame in image coordinates: y grows downwards, so "up" is -y.
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
#: Attribute name -> its values; a label is the value's index here.
ATTRIBUTES: dict[str, tuple[str, ...]] = {"shape": SHAPES, "colour": tuple(COLOURS), "direction": tuple(DIRECTIONS)}
NUM_COMBINATIONS = len(SHAPES) * len(COLOURS) * len(DIRECTIONS)

# Each caption names nearly one clip: a large shape (a quarter of the frame across, so the video model's
# 4x4-pixel tokens can draw its outline), one speed, and a path centred in the frame up to a small jitter.
RADIUS_RANGE = (11.0, 13.0)  # half-extent of the shape, pixels
SPEED = 2.0  # pixels per frame; >= 1 so consecutive frames always differ
START_JITTER = 1.5  # pixels either way around the centred path, along and across the motion


@dataclass(frozen=True)
class ShapeClip:
    """One clip: ``frames`` uint8 ``(NUM_FRAMES, FRAME_SIZE, FRAME_SIZE, 3)``, its caption and attributes.

    ``labels`` are the attribute values' indices in :data:`ATTRIBUTES`; ``centres`` ``(NUM_FRAMES, 2)``
    are the shape's ``(x, y)`` centre per frame, ``radius`` and ``speed`` in pixels (per frame).
    """

    frames: np.ndarray
    caption: str
    attributes: dict[str, str]
    labels: dict[str, int]
    centres: np.ndarray = field(repr=False)
    radius: float
    speed: float


def caption_for(shape: str, colour: str, direction: str) -> str:
    """``"a <colour> <shape> moving <direction>"``."""
    for name, value in (("shape", shape), ("colour", colour), ("direction", direction)):
        if value not in ATTRIBUTES[name]:
            raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(ATTRIBUTES[name])}")
    return f"a {colour} {shape} moving {direction}"


def parse_caption(caption: str) -> dict[str, str]:
    """Inverse of :func:`caption_for`: ``"a red circle moving left"`` -> ``{shape, colour, direction}``."""
    words = caption.strip().lower().split()
    if len(words) != 5 or words[0] != "a" or words[3] != "moving":
        raise ValueError(f"caption {caption!r} is not of the form 'a <colour> <shape> moving <direction>'")
    attributes = {"colour": words[1], "shape": words[2], "direction": words[4]}
    caption_for(**attributes)  # validates every value
    return attributes


def _mask(shape: str, cx: float, cy: float, radius: float, size: int) -> np.ndarray:
    """Boolean ``(size, size)`` mask of ``shape`` centred at pixel-centre coordinates ``(cx, cy)``."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    if shape == "square":
        half = 0.85 * radius  # about the circle's area, so size alone does not give the shape away
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "triangle":
        # Apex up at (0, -r), base at y = +0.8 r from -r to +r (x measured from the centre).
        top, bottom = -radius, 0.8 * radius
        t = (dy - top) / (bottom - top)  # 0 at the apex, 1 at the base
        return (dy >= top) & (dy <= bottom) & (np.abs(dx) <= t * radius)
    raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")


def render_clip(
    shape: str,
    colour: str,
    direction: str,
    start: tuple[float, float],
    radius: float,
    speed: float,
    num_frames: int = NUM_FRAMES,
    size: int = FRAME_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw a clip -> (uint8 ``(num_frames, size, size, 3)``, centres float ``(num_frames, 2)`` as ``(x, y)``)."""
    caption_for(shape, colour, direction)
    if radius <= 0 or speed < 0:
        raise ValueError(f"radius must be > 0 and speed >= 0, got radius={radius}, speed={speed}")
    step = np.array(DIRECTIONS[direction], dtype=np.float64) * speed
    centres = np.asarray(start, dtype=np.float64)[None] + np.arange(num_frames)[:, None] * step[None]
    frames = np.empty((num_frames, size, size, 3), dtype=np.uint8)
    frames[:] = BACKGROUND
    for t, (cx, cy) in enumerate(centres):
        frames[t][_mask(shape, cx, cy, radius, size)] = COLOURS[colour]
    return frames, centres


def _combination(seed: int, k: int) -> tuple[str, str, str]:
    # Each run of 48 consecutive clips is a seeded permutation of all combinations, so any dataset
    # whose size is a multiple of 48 is exactly balanced.
    order = np.random.default_rng([seed, k // NUM_COMBINATIONS, 0]).permutation(NUM_COMBINATIONS)
    index = int(order[k % NUM_COMBINATIONS])
    shape, rest = divmod(index, len(COLOURS) * len(DIRECTIONS))
    colour, direction = divmod(rest, len(DIRECTIONS))
    return SHAPES[shape], tuple(COLOURS)[colour], tuple(DIRECTIONS)[direction]


def shape_clip(k: int, num_clips: int, seed: int = 0) -> ShapeClip:
    """Clip ``k`` of a dataset of ``num_clips`` clips for ``seed``.

    The radius and the path's offset from the centred path are drawn; the whole shape stays inside the
    frame in every frame.
    """
    if num_clips < 1:
        raise ValueError(f"num_clips must be >= 1, got {num_clips}")
    if not 0 <= k < num_clips:
        raise ValueError(f"clip index k={k} is outside the dataset 0..{num_clips - 1}")
    shape, colour, direction = _combination(seed, k)
    rng = np.random.default_rng([seed, k, 1])
    radius = float(rng.uniform(*RADIUS_RANGE))
    speed = SPEED
    middle = (FRAME_SIZE - 1) / 2
    along, across = middle + rng.uniform(-START_JITTER, START_JITTER, size=2)
    dx, dy = DIRECTIONS[direction]
    along -= (dx + dy) * speed * (NUM_FRAMES - 1) / 2  # start half the travel before the path's middle
    start = (float(along), float(across)) if dx != 0 else (float(across), float(along))
    frames, centres = render_clip(shape, colour, direction, start, radius, speed)
    attributes = {"shape": shape, "colour": colour, "direction": direction}
    labels = {name: ATTRIBUTES[name].index(value) for name, value in attributes.items()}
    return ShapeClip(frames, caption_for(shape, colour, direction), attributes, labels, centres, radius, speed)


def generate_clips(
    num_clips: int, seed: int = 0, start: int = 0, count: int | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Clips ``start .. start + count - 1`` (default: all) of a ``num_clips`` dataset, batched.

    Returns uint8 clips ``(n, NUM_FRAMES, FRAME_SIZE, FRAME_SIZE, 3)``, int64 labels ``(n, 3)`` in
    :data:`ATTRIBUTES` order (shape, colour, direction) and the captions.
    """
    count = num_clips - start if count is None else count
    if count < 0 or start < 0 or start + count > num_clips:
        raise ValueError(f"clips {start}..{start + count - 1} are outside the dataset 0..{num_clips - 1}")
    clips = [shape_clip(k, num_clips, seed) for k in range(start, start + count)]
    frames = (
        np.stack([c.frames for c in clips]) if clips else np.zeros((0, NUM_FRAMES, FRAME_SIZE, FRAME_SIZE, 3), np.uint8)
    )
    labels = np.array([[c.labels[name] for name in ATTRIBUTES] for c in clips], dtype=np.int64).reshape(
        -1, len(ATTRIBUTES)
    )
    return frames, labels, [c.caption for c in clips]
