"""Measurements of a long bouncing-shapes video, from its frames alone (issue 48's long-video report).

* :func:`centroids`: the shape's ``(x, y)`` centroid per frame;
* :func:`window_readings`: the video judge's shape and colour reading of each 9-frame window, against the prompt;
* :func:`measure_long_video`: the report's measures (:class:`LongVideoMeasures`): the share of windows whose shape
  and colour match the prompt, the largest centroid jump between consecutive frames (all of them, and across chunk
  borders), the speed drift from the first chunk to the last;
* the three ways to get a long video (:func:`stream_frames` for a streaming pipeline, :func:`independent_clips`
  for the naive baseline: a non-streaming model's clips placed one after another), each returning the uint8
  frames and where its chunks start, and :func:`timed` (wall time and peak tensor memory of one call).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...pipelines.outputs import float_to_uint8
from ..judges.video_judge import VideoJudge, predict_attributes
from ..worlds.moving_shapes import ATTRIBUTES, BACKGROUND, COLOURS, parse_caption

__all__ = [
    "SHAPE_THRESHOLD",
    "LongVideoMeasures",
    "TimedCall",
    "WindowReading",
    "centroids",
    "independent_clips",
    "measure_long_video",
    "stream_frames",
    "timed",
    "window_readings",
]

#: A pixel belongs to the shape when one of its channels differs from :data:`BACKGROUND` by more than this (of 255):
#: half the smallest contrast of any shape colour with the background (green's 200 - 16 = 184 in its brightest
#: channel). Blur spreads an edge symmetrically about the half-contrast level, so a mask cut there keeps a green
#: shape's edges where they were, and cuts the brighter colours' edges a little further out, the same on every side:
#: the centroid stays put. Decoder noise would need to reach 92 levels to add or drop a pixel.
SHAPE_THRESHOLD = min(max(abs(c - b) for c, b in zip(colour, BACKGROUND)) for colour in COLOURS.values()) // 2


def _video(frames: np.ndarray, what: str = "frames") -> np.ndarray:
    """``frames`` ``(T, H, W, 3)`` as uint8 (floats in ``[0, 1]``, as pipelines return them, are rounded)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"{what} must be one video (T, H, W, 3) with T >= 1, got shape {frames.shape}")
    if frames.dtype != np.uint8 and not np.issubdtype(frames.dtype, np.floating):
        raise ValueError(f"{what} must be uint8 or floats in [0, 1], got {frames.dtype}")
    return float_to_uint8(frames)


def centroids(frames: np.ndarray) -> np.ndarray:
    """The shape's ``(x, y)`` centroid per frame, float64 ``(T, 2)`` in pixels (pixel centres at integers).

    ``frames``: one video ``(T, H, W, 3)``, uint8 or floats in ``[0, 1]``. The shape is every pixel that differs
    from the background by more than :data:`SHAPE_THRESHOLD` in some channel; a frame without such a pixel gets a
    NaN row.
    """
    frames = _video(frames)
    mask = (np.abs(frames.astype(np.int16) - np.array(BACKGROUND, np.int16)) > SHAPE_THRESHOLD).any(axis=-1)
    counts = mask.sum(axis=(1, 2)).astype(np.float64)
    ys, xs = np.arange(frames.shape[1], dtype=np.float64), np.arange(frames.shape[2], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0 -> NaN: no shape in that frame
        x = (mask.sum(axis=1) * xs).sum(axis=1) / counts
        y = (mask.sum(axis=2) * ys).sum(axis=1) / counts
    return np.stack([x, y], axis=1)


@dataclass(frozen=True)
class WindowReading:
    """The judge's reading of the window of frames ``start .. start + length - 1``: the shape, colour and direction
    it read, and whether shape and colour are the prompt's (the direction is not compared: a bounce reverses it)."""

    start: int
    length: int
    shape: str
    colour: str
    direction: str
    matches: bool


def window_readings(
    judge: VideoJudge, frames: np.ndarray, prompt: str, window: int | None = None, stride: int | None = None
) -> list[WindowReading]:
    """The judge's reading of each window of ``frames`` ``(T, H, W, 3)`` generated for ``prompt``.

    Windows are as long as the judge reads (9 frames for the embedded judges; ``window``, when given, must say so)
    and start at frames ``0, stride, 2 stride, ...`` while they fit; ``stride`` defaults to the window's length
    (windows side by side, no overlap). Frames after the last whole window (``(T - window) % stride`` of them) are
    not read.
    ``prompt``: ``"a <colour> <shape> moving <direction>"`` (:func:`~.moving_shapes.parse_caption`).
    """
    requested = parse_caption(prompt)
    if not isinstance(judge, VideoJudge):
        raise ValueError(f"judge must be a VideoJudge (load_judge(embedded_judge(...))), got {type(judge).__name__}")
    frames = _video(frames)
    length, size = judge.config["num_frames"], judge.config["frame_size"]
    if window is not None and window != length:
        raise ValueError(f"the judge reads windows of {length} frames, not {window}: leave window out or pass {length}")
    stride = length if stride is None else stride
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be a whole number of frames >= 1, got {stride!r}")
    if frames.shape[1:3] != (size, size):
        raise ValueError(f"the judge reads {size}x{size} frames, got {frames.shape[2]}x{frames.shape[1]}")
    if len(frames) < length:
        raise ValueError(f"the video has {len(frames)} frames: the judge needs at least one window of {length}")
    starts = list(range(0, len(frames) - length + 1, stride))
    windows = np.stack([frames[s : s + length] for s in starts])
    predicted = predict_attributes(judge, windows)
    names = {name: i for i, name in enumerate(ATTRIBUTES)}
    readings = []
    for start, labels in zip(starts, predicted):
        read = {name: ATTRIBUTES[name][labels[i]] for name, i in names.items()}
        matches = read["shape"] == requested["shape"] and read["colour"] == requested["colour"]
        readings.append(WindowReading(start, length, read["shape"], read["colour"], read["direction"], matches))
    return readings


@dataclass(frozen=True)
class LongVideoMeasures:
    """What :func:`measure_long_video` measured in one video (distances in pixels, speeds in pixels per frame).

    A frame without a shape (:func:`centroids`' NaN rows, listed in ``missing_frames``) makes every jump to or from
    it undefined, and an undefined jump counts as a failure: ``max_jump`` (and ``border_jump`` when it is at a
    border) is then ``inf``. ``speed_drift`` takes the median of the defined jumps; it is NaN when the first or the
    last chunk has none. ``border_jump`` and ``speed_drift`` are ``None`` for a video of one chunk.
    """

    num_frames: int
    chunk_starts: tuple[int, ...]
    #: Share of windows whose shape and colour both match the prompt.
    window_match: float
    num_windows: int
    #: Largest centroid jump between consecutive frames, chunk borders included.
    max_jump: float
    #: Largest centroid jump between the last frame of a chunk and the first of the next.
    border_jump: float | None
    #: Median speed over the last chunk / over the first (each with the one border jump on its inner side).
    speed_drift: float | None
    #: Median centroid jump between consecutive frames over the whole video.
    median_speed: float
    missing_frames: tuple[int, ...]
    readings: tuple[WindowReading, ...] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        """The measures for a JSON file (strict JSON: an infinite or NaN value is ``null``, ``missing_frames`` says
        why)."""

        def number(value: float | None) -> float | None:
            return None if value is None or not math.isfinite(value) else round(float(value), 4)

        return {
            "num_frames": self.num_frames,
            "chunk_starts": list(self.chunk_starts),
            "window_match": number(self.window_match),
            "num_windows": self.num_windows,
            "max_jump_px": number(self.max_jump),
            "border_jump_px": number(self.border_jump),
            "speed_drift": number(self.speed_drift),
            "median_speed_px": number(self.median_speed),
            "missing_frames": list(self.missing_frames),
            "windows": [
                {"start": r.start, "shape": r.shape, "colour": r.colour, "direction": r.direction, "matches": r.matches}
                for r in self.readings
            ],
        }


def _chunk_starts(chunk_starts: Sequence[int], num_frames: int) -> tuple[int, ...]:
    if not all(isinstance(s, (int, np.integer)) for s in chunk_starts):
        raise ValueError(f"chunk_starts must be whole frame indices, got {list(chunk_starts)}")
    starts = tuple(int(s) for s in chunk_starts)
    if any(b <= a for a, b in zip(starts, starts[1:])) or (starts and not 0 < starts[0] <= starts[-1] < num_frames):
        raise ValueError(
            f"chunk_starts must rise strictly within 1..{num_frames - 1} (the first frame of each chunk after the "
            f"first), got {list(starts)}"
        )
    return starts


def _largest(jumps: np.ndarray) -> float:
    """The largest of ``jumps``; ``inf`` when one is undefined (NaN: a frame without a shape)."""
    return float("inf") if np.isnan(jumps).any() else float(jumps.max())


def _median(jumps: np.ndarray) -> float:
    defined = jumps[~np.isnan(jumps)]
    return float(np.median(defined)) if len(defined) else float("nan")


def measure_long_video(
    judge: VideoJudge, frames: np.ndarray, prompt: str, chunk_starts: Sequence[int], stride: int | None = None
) -> LongVideoMeasures:
    """Measure one long video ``frames`` ``(T, H, W, 3)`` (uint8 or floats in ``[0, 1]``) generated for ``prompt``.

    ``chunk_starts``: the first frame index of every chunk after the first (what :func:`stream_frames` and
    :func:`independent_clips` return; empty for a video made in one piece). ``stride``: of the judge's windows
    (:func:`window_readings`). The speed drift compares the first chunk (its frames and the next chunk's first
    frame) with the last (its frames and the frame before it): a stream's first chunk may be a single frame, the
    causal VAE's ``1 + 4 (c - 1)``.
    """
    frames = _video(frames)
    starts = _chunk_starts(chunk_starts, len(frames))
    readings = window_readings(judge, frames, prompt, stride=stride)  # checks the judge, prompt and size first
    points = centroids(frames)
    jumps = np.linalg.norm(np.diff(points, axis=0), axis=1)  # jumps[t]: frame t -> t + 1; NaN without a shape
    border = _largest(jumps[[s - 1 for s in starts]]) if starts else None
    drift = None
    if starts:
        first, last = _median(jumps[: starts[0]]), _median(jumps[starts[-1] - 1 :])
        if first == 0:  # a shape that stood still: drift 1 if it still does, unbounded if it moves now
            drift = 1.0 if last == 0 else (math.inf if last > 0 else math.nan)
        else:
            drift = last / first  # NaN when either chunk has no defined jump
    return LongVideoMeasures(
        num_frames=len(frames),
        chunk_starts=starts,
        window_match=sum(r.matches for r in readings) / len(readings),
        num_windows=len(readings),
        max_jump=_largest(jumps),
        border_jump=border,
        speed_drift=drift,
        median_speed=_median(jumps),
        missing_frames=tuple(int(t) for t in np.flatnonzero(np.isnan(points[:, 0]))),
        readings=tuple(readings),
    )


#: Arguments of the pipeline call that :func:`independent_clips` and :func:`stream_frames` set themselves.
_SET_HERE = ("prompt", "num_frames", "generator", "output_type", "return_dict", "num_videos_per_prompt")


def _check_call(num_frames: int, seed: int, call_kwargs: dict[str, Any], reserved: Sequence[str]) -> None:
    taken = sorted(set(call_kwargs) & set(reserved))
    if taken:
        raise ValueError(f"{', '.join(taken)} are set by this function: pass prompt, num_frames and seed as arguments")
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"num_frames must be a whole number >= 1, got {num_frames!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def independent_clips(
    pipe: Any, prompt: str, num_frames: int, seed: int, clip_frames: int | None = None, **call_kwargs: Any
) -> tuple[np.ndarray, list[int]]:
    """The naive long video: ``pipe`` (a non-streaming text-to-video pipeline, e.g. ``MHLAWanPipeline`` of
    ``embedded_model("text-to-video", "mhla")``) run as independent clips of ``clip_frames`` frames (default: the
    embedded models' 9) with seeds ``seed, seed + 1, ...``, placed one after another and cut to ``num_frames``.

    ``call_kwargs`` go to every call (height, width, steps, guidance, ...). Returns the uint8 frames
    ``(num_frames, H, W, 3)`` and the chunk starts (the clips' first frames after the first clip's).
    """
    from ..locations import embedded_defaults

    _check_call(num_frames, seed, call_kwargs, _SET_HERE)
    clip_frames = embedded_defaults().num_frames if clip_frames is None else clip_frames
    if not isinstance(clip_frames, int) or clip_frames < 1:
        raise ValueError(f"clip_frames must be a whole number >= 1, got {clip_frames!r}")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be one text, got {type(prompt).__name__}")
    clips = []
    for i in range(math.ceil(num_frames / clip_frames)):
        generator = torch.Generator("cpu").manual_seed(seed + i)
        video = pipe(
            prompt=prompt,
            num_frames=clip_frames,
            generator=generator,
            output_type="np",
            return_dict=False,
            **call_kwargs,
        )[0]
        clips.append(float_to_uint8(video[0]))
    frames = np.concatenate(clips)[:num_frames]
    return frames, list(range(clip_frames, num_frames, clip_frames))


def stream_frames(
    pipe: Any, prompt: str, num_frames: int, seed: int, chunk_frames: int | None = None, **call_kwargs: Any
) -> tuple[np.ndarray, list[int]]:
    """A streamed long video: ``pipe`` (``MHLAWanStreamingPipeline``, or any pipeline with its ``on_frames`` /
    ``return_frames`` call) generates ``num_frames`` frames chunk by chunk with seed ``seed``, keeping none itself
    (``return_frames=False``); each chunk's frames are collected as uint8 from ``on_frames``.

    ``call_kwargs`` go to the call. Returns the uint8 frames ``(num_frames, H, W, 3)`` and the chunk starts (from
    each ``on_frames`` call's frame count).
    """
    _check_call(num_frames, seed, call_kwargs, (*_SET_HERE, "on_frames", "return_frames", "chunk_frames"))
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be one text, got {type(prompt).__name__}")
    if "on_frames" not in inspect.signature(pipe.__call__).parameters:
        raise ValueError(f"{type(pipe).__name__} does not stream (no on_frames): use MHLAWanStreamingPipeline")
    chunks: list[np.ndarray] = []
    pipe(
        prompt=prompt,
        num_frames=num_frames,
        chunk_frames=chunk_frames,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        on_frames=lambda frames: chunks.append(float_to_uint8(frames[0])),
        return_frames=False,
        **call_kwargs,
    )
    starts = np.cumsum([len(chunk) for chunk in chunks])[:-1]
    return np.concatenate(chunks), [int(s) for s in starts]


@dataclass(frozen=True)
class TimedCall:
    """One call's result, its wall seconds (``None`` when not timed) and the peak extra tensor memory a call
    allocates, in bytes (:class:`~mhla_diffusion.benchmarks.bench.PeakMemory`)."""

    result: Any
    seconds: float | None
    peak_bytes: int


def timed(fn: Callable[[], Any], device: torch.device | str = "cpu", wall_time: bool = True) -> TimedCall:
    """Peak tensor memory and wall time of ``fn()``, from two calls: one under
    :class:`~mhla_diffusion.benchmarks.bench.PeakMemory` on ``device`` for the peak (on a CPU every tensor made in the
    call, tracked until freed; NumPy arrays such as collected frames do not count), then one timed by the wall clock,
    whose result is returned. Two calls because the CPU tracking costs time of its own (it made the embedded
    text-to-video model's call 2.8x slower); the first call also pays what only a first call pays.
    ``wall_time=False``: the tracked call only (its result; ``seconds`` is ``None``), when the time is taken elsewhere.
    """
    from ...benchmarks.bench import PeakMemory

    if not callable(fn):
        raise ValueError(f"timed needs a function of no arguments, got {type(fn).__name__}")
    device = torch.device(device)
    with PeakMemory(device) as memory:
        result = fn()
    if not wall_time:
        return TimedCall(result, None, memory.peak)
    del result  # not alive during the timed call
    began = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return TimedCall(result, time.perf_counter() - began, memory.peak)
