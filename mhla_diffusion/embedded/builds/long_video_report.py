"""The long-video report of ``mhla build-embedded --stream``: three ways to make a video 8x the training length.

On the same prompts and seeds, at ``eval_frames`` frames (:class:`~.stream_build.StreamBuildSettings`):

* **streaming MHLA**: the block-causal MHLA model, chunk by chunk with its constant-size state;
* **softmax KV cache**: its block-causal softmax reference, chunk by chunk with a growing KV cache;
* **independent clips**: the non-streaming embedded MHLA model (``shapes-t2v-mhla``), run as 9-frame clips
  with seeds ``seed, seed + 1, ...`` placed one after another: the naive way to get length;
* and **real videos**: the bouncing-shapes data itself for the same prompts, what the measures read on truth.

Each video is measured from its frames alone (:func:`~.long_video.measure_long_video`): the long-video judge's
shape and colour per 9-frame window, the object's centroid per frame, the largest frame-to-frame centroid jump
(chunk borders included), the speed drift of the last ``train_frames`` frames against the first. Wall time is
the median seconds per video; peak memory is the peak extra tensor memory of one video with no frames kept
(``return_frames=False``), at the training length (1x) and at ``eval_frames``.

Every finished method is kept in ``<work>/evaluate/<method>.json``, so a killed evaluation resumes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..judges.judge_io import load_judge
from ..locations import embedded_defaults
from ..worlds.bouncing_shapes import SPEED_RANGE, bouncing_clip
from ..worlds.moving_shapes import NUM_COMBINATIONS, parse_caption
from .reproduction import balanced_captions

__all__ = ["CLI_PROMPT", "METHODS", "evaluate_long_video", "evaluation_prompts", "report_markdown"]

EVAL_SEED = 30_000
#: The prompt of the README's streaming command, whose reading the report records.
CLI_PROMPT = "a red circle moving left"
#: Method key -> the name the report gives it.
METHODS = {
    "real": "real videos (the data)",
    "stream-mhla": "streaming MHLA",
    "stream-softmax": "softmax KV cache (block-causal teacher)",
    "independent": "independent clips (non-streaming MHLA)",
}


def evaluation_prompts(count: int) -> list[str]:
    """``count`` (at most 48) different prompts spread over shapes, colours and directions: combination ``13 i mod 48``
    of :func:`~.reproduction.balanced_captions`' order (13 is prime to 48, so none repeats; the first ``count`` of
    that order would be circles only)."""
    if not 1 <= count <= NUM_COMBINATIONS:
        raise ValueError(f"eval_prompts must be 1..{NUM_COMBINATIONS}, got {count}")
    captions, _ = balanced_captions(NUM_COMBINATIONS)
    return [captions[(13 * i) % NUM_COMBINATIONS] for i in range(count)]


def _real_video(prompt: str, index: int, num_frames: int) -> tuple[np.ndarray, list[int]]:
    """A bouncing-shapes video of ``prompt`` (the data's own motion), with chunk starts every 2 frames."""
    attributes = parse_caption(prompt)
    k = 0
    while True:  # the first clip of the evaluation's data with this caption, from the index-th 48
        clip = bouncing_clip(48 * index + k, 48 * (index + 1), EVAL_SEED, num_frames)
        if clip.attributes == attributes:
            return clip.frames, list(range(1, num_frames, 2))
        k += 1


def generation_options(s) -> dict[str, Any]:
    """The pipeline call's options of every evaluated video: the build's steps and guidance, the embedded size."""
    d = embedded_defaults()
    return dict(
        num_inference_steps=s.eval_steps,
        guidance_scale=s.guidance_scale,
        height=d.height,
        width=d.width,
        max_sequence_length=d.max_sequence_length,
        negative_prompt="",  # the command line's default
    )


def _method_runs(work: Path, s, source: Path) -> dict[str, Callable[[str, int, int], tuple[np.ndarray, list[int]]]]:
    """Method key -> ``run(prompt, seed, num_frames) -> (frames uint8 (T, H, W, 3), chunk starts)``."""
    from ...pipelines import MHLAWanPipeline, MHLAWanStreamingPipeline
    from .long_video import independent_clips, stream_frames

    common = generation_options(s)
    mhla = MHLAWanStreamingPipeline.from_pretrained(work / "runs" / "long-mhla" / "pipeline")
    softmax = MHLAWanStreamingPipeline.from_pretrained(work / "runs" / "long-softmax" / "pipeline")
    clips = MHLAWanPipeline.from_pretrained(source / "shapes-t2v-mhla")
    for pipe in (mhla, softmax, clips):
        pipe.set_progress_bar_config(disable=True)
    chunking = dict(chunk_frames=s.chunk_frames, first_chunk_frames=s.first_chunk_frames)
    return {
        "stream-mhla": lambda p, seed, n: stream_frames(mhla, p, n, seed, **chunking, **common),
        "stream-softmax": lambda p, seed, n: stream_frames(softmax, p, n, seed, **chunking, **common),
        "independent": lambda p, seed, n: independent_clips(clips, p, n, seed, **common),
    }


def _segment_drift(frames: np.ndarray, segment: int) -> float | None:
    """Median centroid speed over the last ``segment`` frames / over the first ``segment`` (``None``: undefined)."""
    from .long_video import centroids

    jumps = np.linalg.norm(np.diff(centroids(frames), axis=0), axis=1)
    first, last = jumps[: segment - 1], jumps[-(segment - 1) :]
    if np.isnan(first).all() or np.isnan(last).all():
        return None
    first_speed, last_speed = float(np.nanmedian(first)), float(np.nanmedian(last))
    return None if first_speed == 0 else round(last_speed / first_speed, 4)


def largest_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """The largest ``key`` over per-video rows; ``None`` when one video's is (a frame without a shape)."""
    values = [r[key] for r in rows]
    return None if any(v is None for v in values) else max(values)


def windows_match(rows: list[dict[str, Any]]) -> float:
    """The share of all the rows' judge windows that match their prompt."""
    return sum(r["window_match"] * r["num_windows"] for r in rows) / sum(r["num_windows"] for r in rows)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-video measures -> the table's numbers for one method (an undefined jump, a frame with no shape, is
    ``None`` in a row and makes the method's largest jump ``None``: shown as "shape lost")."""

    drifts = [r["segment_speed_drift"] for r in rows if r["segment_speed_drift"] is not None]
    seconds = [r["seconds"] for r in rows if r["seconds"] is not None]
    return {
        "videos": len(rows),
        "windows_match": windows_match(rows),
        "largest_jump_px": largest_of(rows, "max_jump_px"),
        "largest_border_jump_px": largest_of(rows, "border_jump_px"),
        "videos_with_missing_frames": sum(bool(r["missing_frames"]) for r in rows),
        "speed_drift_median": statistics.median(drifts) if drifts else None,
        "speed_drift_range": [min(drifts), max(drifts)] if drifts else None,
        "median_seconds": statistics.median(seconds) if seconds else None,
    }


def evaluate_long_video(work: Path, s, source: Path) -> dict[str, Any]:
    """The report (module docstring); writes ``<work>/evaluate/long_video_report.json`` / ``.md`` and the strip."""
    import time

    from .long_video import measure_long_video, timed

    folder = work / "evaluate"
    folder.mkdir(parents=True, exist_ok=True)
    judge = load_judge(work / "judges" / "long-video")
    prompts = evaluation_prompts(s.eval_prompts)
    runs = _method_runs(work, s, source)
    results: dict[str, Any] = {}
    strips: dict[str, np.ndarray] = {}
    for key, name in METHODS.items():
        saved = folder / f"{key}.json"
        if saved.is_file():
            results[key] = json.loads(saved.read_text())
            continue
        rows = []
        for i, prompt in enumerate(prompts):
            seed = EVAL_SEED + i
            began = time.perf_counter()
            if key == "real":
                frames, starts = _real_video(prompt, i, s.eval_frames)
                seconds = None
            else:
                frames, starts = runs[key](prompt, seed, s.eval_frames)
                seconds = round(time.perf_counter() - began, 3)
            measures = measure_long_video(judge, frames, prompt, starts).to_json()
            drift = _segment_drift(frames, s.train_frames)
            rows.append({"prompt": prompt, "seed": seed, "seconds": seconds, "segment_speed_drift": drift, **measures})
            if i == 0:
                np.save(folder / f"{key}-first.npy", frames)
        result = {"name": name, "summary": _summary(rows), "videos": rows}
        if key in ("stream-mhla", "stream-softmax"):
            peaks = {}
            for label, frames_count in (("1x", s.train_frames), ("8x", s.eval_frames)):
                peaks[label] = timed(lambda: runs[key](prompts[0], EVAL_SEED, frames_count), wall_time=False).peak_bytes
            result["peak_mb"] = {label: round(peak / 2**20, 2) for label, peak in peaks.items()}
            result["peak_8x_vs_1x"] = round(peaks["8x"] / peaks["1x"], 3)
        saved.write_text(json.dumps(result, indent=2))
        results[key] = result
    for key in METHODS:
        strips[key] = np.load(folder / f"{key}-first.npy")
    # what `mhla text-to-video --stream --num-frames <eval_frames> --prompt "<CLI_PROMPT>"` makes (seed 0, the
    # model's recorded settings): the test of that command compares its judge reading with this
    frames, starts = runs["stream-mhla"](CLI_PROMPT, 0, s.eval_frames)
    command = {"prompt": CLI_PROMPT, "seed": 0, "num_frames": s.eval_frames}
    command["judge"] = measure_long_video(judge, frames, CLI_PROMPT, starts).to_json()
    report = {
        "settings": {
            "train_frames": s.train_frames,
            "eval_frames": s.eval_frames,
            "prompts": len(prompts),
            "chunk_frames": s.chunk_frames,
            "first_chunk_frames": s.first_chunk_frames,
            "context_noise": s.context_noise,
            "steps": s.eval_steps,
            "guidance_scale": s.guidance_scale,
            "data_speed_px_per_frame": list(SPEED_RANGE),
        },
        "methods": results,
        "command": command,
    }
    (folder / "long_video_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "long_video_report.md").write_text(report_markdown(report))
    _strip(strips, prompts[0], folder / "long-video-strip.png")
    return {
        key: {**value["summary"], **{k: v for k, v in value.items() if k.startswith("peak")}}
        for key, value in results.items()
    }


def report_markdown(report: dict[str, Any]) -> str:
    """The report's table (one column per method)."""
    settings, methods = report["settings"], report["methods"]
    keys = list(methods)
    header = "| Measure | " + " | ".join(methods[k]["name"] for k in keys) + " |"
    lines = [header, "|---|" + "---|" * len(keys)]

    def row(label: str, fn: Callable[[dict[str, Any]], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(methods[k]) for k in keys) + " |")

    def number(value: float | None, form: str = ".2f") -> str:
        return "shape lost" if value is None else format(value, form)

    row("windows whose shape and colour match the prompt", lambda m: f"{100 * m['summary']['windows_match']:.1f} %")
    row("largest centroid jump, consecutive frames (px)", lambda m: number(m["summary"]["largest_jump_px"]))
    row("largest centroid jump at chunk borders (px)", lambda m: number(m["summary"]["largest_border_jump_px"]))
    row(
        f"speed drift, last {settings['train_frames']} frames vs first (median [range])",
        lambda m: (
            "-"
            if m["summary"]["speed_drift_median"] is None
            else "{:.2f} [{:.2f}, {:.2f}]".format(
                m["summary"]["speed_drift_median"], *m["summary"]["speed_drift_range"]
            )
        ),
    )
    row(
        "wall time per video (s, median)",
        lambda m: "-" if m["summary"]["median_seconds"] is None else f"{m['summary']['median_seconds']:.1f}",
    )
    row(
        f"peak extra memory, {settings['train_frames']} / {settings['eval_frames']} frames (MiB)",
        lambda m: "-" if "peak_mb" not in m else f"{m['peak_mb']['1x']:.1f} / {m['peak_mb']['8x']:.1f}",
    )
    return "\n".join(lines) + "\n"


def _strip(videos: dict[str, np.ndarray], prompt: str, path: Path, every: int = 8) -> None:
    """One row of frames (every ``every``-th) per method for the first prompt, labelled; written as PNG."""
    from PIL import Image, ImageDraw

    label_width, gap = 170, 2
    rows = [(METHODS[key], video[::every]) for key, video in videos.items()]
    height, width = rows[0][1].shape[1:3]
    count = max(len(frames) for _, frames in rows)
    canvas = Image.new("RGB", (label_width + count * (width + gap), 14 + len(rows) * (height + gap)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((2, 1), f'"{prompt}", every {every}th frame', fill=(0, 0, 0))
    for r, (name, frames) in enumerate(rows):
        top = 14 + r * (height + gap)
        lines = _wrapped(draw, name, label_width - 4)  # whole, on as many lines as it needs
        line_height = 11
        draw.multiline_text(
            (2, top + max(0, (height - line_height * len(lines)) // 2)), "\n".join(lines), fill=(0, 0, 0)
        )
        for c, frame in enumerate(frames):
            canvas.paste(Image.fromarray(frame), (label_width + c * (width + gap), top))
    canvas.save(path)


def _wrapped(draw, text: str, width: int) -> list[str]:
    """``text`` cut at spaces into lines no wider than ``width`` pixels in ``draw``'s font (a longer word alone)."""
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines
