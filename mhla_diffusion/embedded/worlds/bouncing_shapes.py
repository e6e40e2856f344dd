"""Procedural "bouncing shapes" videos of any length: the streaming model's data.

The moving-shapes world (:mod:`.moving_shapes`: 3 shapes x 4 colours x 4 directions, the same captions) with
motion that never ends: the shape moves at a constant speed and bounces off the frame's edges (the centre is
reflected so the whole shape stays inside the frame), so a clip of any length stays in the data's world. The
caption names the shape, the colour and the *starting* direction; the speed and the start position are drawn.

Clip ``k`` of ``seed`` is a pure function of ``(seed, k, num_frames)``, and a longer clip of the same ``(seed, k)``
begins with the shorter one's frames: its start, radius and speed do not depend on the length.
"""

from __future__ import annotations

import numpy as np

from .moving_shapes import (
    ATTRIBUTES,
    BACKGROUND,
    COLOURS,
    DIRECTIONS,
    FRAME_SIZE,
    NUM_FRAMES,
    RADIUS_RANGE,
    ShapeClip,
    _combination,
    _mask,
    caption_for,
)

__all__ = [
    "BOUNCE_FRAMES",
    "SPEED_RANGE",
    "WINDOW_OFFSETS",
    "bounce_path",
    "bouncing_clip",
    "bouncing_windows",
    "render_bouncing",
]

#: Frames of a training clip: 17 frames = 9 latent frames of the embedded video VAE (``1 + 2k`` -> ``1 + k``).
BOUNCE_FRAMES = 17
#: Pixels per frame. At most 2.5 so that a bounce (which reverses the motion within one frame) never moves the
#: centre by more than the speed.
SPEED_RANGE = (1.5, 2.5)


def bounce_path(start: float, velocity: float, low: float, high: float, num_frames: int) -> np.ndarray:
    """Positions ``(num_frames,)`` of a point moving at ``velocity`` per frame from ``start``, reflected at
    ``low`` and ``high`` (``low < high``; ``start`` inside)."""
    if not low < high or not low <= start <= high:
        raise ValueError(f"need low < high and low <= start <= high, got {low}, {high}, start {start}")
    span = high - low
    free = start - low + velocity * np.arange(num_frames, dtype=np.float64)  # unfolded path from `low`
    folded = np.mod(free, 2 * span)
    return low + np.where(folded <= span, folded, 2 * span - folded)


def render_bouncing(
    shape: str,
    colour: str,
    direction: str,
    start: tuple[float, float],
    radius: float,
    speed: float,
    num_frames: int,
    size: int = FRAME_SIZE,
    first: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw a bouncing clip -> (uint8 ``(num_frames - first, size, size, 3)``, centres float ``(num_frames, 2)``
    ``(x, y)``).

    The centre moves ``speed`` pixels per frame, first towards ``direction``, and is reflected at ``radius`` from
    each edge, so the whole shape stays inside the frame. Only frames ``first ..`` are drawn (a window of a long
    clip); the centres are those of every frame.
    """
    caption_for(shape, colour, direction)
    if radius <= 0 or speed <= 0 or num_frames < 1:
        raise ValueError(f"need radius > 0, speed > 0, num_frames >= 1; got {radius}, {speed}, {num_frames}")
    low, high = radius, size - 1 - radius
    dx, dy = DIRECTIONS[direction]
    xs = bounce_path(start[0], dx * speed, low, high, num_frames) if dx else np.full(num_frames, start[0])
    ys = bounce_path(start[1], dy * speed, low, high, num_frames) if dy else np.full(num_frames, start[1])
    centres = np.stack([xs, ys], axis=1)
    if not 0 <= first < num_frames:
        raise ValueError(f"first must be in 0..{num_frames - 1}, got {first}")
    frames = np.empty((num_frames - first, size, size, 3), dtype=np.uint8)
    frames[:] = BACKGROUND
    for t, (cx, cy) in enumerate(centres[first:]):
        frames[t][_mask(shape, cx, cy, radius, size)] = COLOURS[colour]
    return frames, centres


def bouncing_clip(k: int, num_clips: int, seed: int = 0, num_frames: int = BOUNCE_FRAMES, first: int = 0) -> ShapeClip:
    """Clip ``k`` of a ``num_clips`` bouncing dataset for ``seed``, ``num_frames`` long (its frames ``first ..``;
    ``centres`` and every other field describe the same frames).

    Attributes are balanced as in :func:`~.moving_shapes.shape_clip` (every 48 consecutive clips hold each caption
    once). Drawn: the radius, the speed (:data:`SPEED_RANGE`) and the start anywhere the shape fits.
    """
    if num_clips < 1 or not 0 <= k < num_clips:
        raise ValueError(f"clip index k={k} is outside the dataset 0..{num_clips - 1}")
    shape, colour, direction = _combination(seed, k)
    rng = np.random.default_rng([seed, k, 2])
    radius = float(rng.uniform(*RADIUS_RANGE))
    speed = float(rng.uniform(*SPEED_RANGE))
    start = tuple(float(v) for v in rng.uniform(radius, FRAME_SIZE - 1 - radius, size=2))
    frames, centres = render_bouncing(shape, colour, direction, start, radius, speed, num_frames, first=first)
    centres = centres[first:]
    attributes = {"shape": shape, "colour": colour, "direction": direction}
    labels = {name: ATTRIBUTES[name].index(value) for name, value in attributes.items()}
    return ShapeClip(frames, caption_for(shape, colour, direction), attributes, labels, centres, radius, speed)


#: How far into a bouncing clip :func:`bouncing_windows` may start a window (frames).
WINDOW_OFFSETS = 128


def bouncing_windows(
    num_windows: int, seed: int = 0, start: int = 0, count: int | None = None, frames: int = NUM_FRAMES
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Windows ``start .. start + count - 1`` of ``frames`` frames, each cut from its own bouncing clip at a drawn
    offset in ``0 .. WINDOW_OFFSETS`` (what a judge of long videos reads: shapes near the edges, bounces).

    Returns uint8 windows ``(n, frames, FRAME_SIZE, FRAME_SIZE, 3)``, int64 labels ``(n, 3)`` in
    :data:`ATTRIBUTES` order and the clips' captions. The direction label is the motion's direction across the
    window's middle frames (after a bounce it is the reverse of the caption's starting direction).
    """
    count = num_windows - start if count is None else count
    if count < 0 or start < 0 or start + count > num_windows:
        raise ValueError(f"windows {start}..{start + count - 1} are outside 0..{num_windows - 1}")
    windows, labels, captions = [], [], []
    for k in range(start, start + count):
        offset = int(np.random.default_rng([seed, k, 3]).integers(0, WINDOW_OFFSETS + 1))
        clip = bouncing_clip(k, num_windows, seed, offset + frames, first=offset)
        centres = clip.centres
        windows.append(clip.frames)
        middle = frames // 2
        dx, dy = DIRECTIONS[clip.attributes["direction"]]
        axis = 0 if dx else 1
        moved = centres[min(middle + 1, frames - 1), axis] - centres[max(middle - 1, 0), axis]
        sign = 1 if moved > 0 else -1
        direction = next(name for name, step in DIRECTIONS.items() if step[axis] == sign and step[1 - axis] == 0)
        labels.append([clip.labels["shape"], clip.labels["colour"], ATTRIBUTES["direction"].index(direction)])
        captions.append(clip.caption)
    shape = (0, frames, FRAME_SIZE, FRAME_SIZE, 3)
    return (
        np.stack(windows) if windows else np.zeros(shape, np.uint8),
        np.array(labels, dtype=np.int64).reshape(-1, len(ATTRIBUTES)),
        captions,
    )
