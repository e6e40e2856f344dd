"""Diagnostics of a long-video pilot (``mhla build-embedded --stream --diagnose``), read before any long build.

For each streaming model a pilot's work dir holds (``runs/long-mhla``, ``runs/long-softmax``), on the evaluation's
prompts and seeds:

* **Length readings** at 2x and 8x the training length (``LENGTH_FACTORS``): the share of 9-frame windows whose shape
  and colour the long-video judge reads as the prompt's, the largest frame-to-frame centroid jump at chunk borders and
  inside chunks, and the speed drift (median speed of the last chunk over the first), from
  :func:`~.long_video.measure_long_video`.
* **Oracle context**: the true first two chunks of a bouncing-shapes video of the prompt are given
  (``context_latents``: the real frames through the VAE) and the model makes the next two (or as many as one judge
  window needs). The real video continues
  with the same physics, so its centroids are the answer. Read: the judge's verdict on the generated frames, the jump
  at the border between the given and the made frames (against the real video's own jump there), and the mean
  distance of the made centroids from the true ones, beside two guesses that need no model: holding the last given
  position, and moving straight on at the last given velocity. A model that reads its context lands nearer the truth
  than holding still; one that ignores it starts anywhere.

The readings are written to ``<work>/diagnosis/<run>.json`` and ``.md``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..judges.judge_io import load_judge
from ..worlds.bouncing_shapes import SPEED_RANGE
from .long_video import centroids, measure_long_video, stream_frames, window_readings
from .long_video_report import (
    EVAL_SEED,
    _real_video,
    evaluation_prompts,
    generation_options,
    largest_of,
    windows_match,
)

__all__ = ["DIAGNOSED_RUNS", "LENGTH_FACTORS", "diagnose_pilot", "diagnosis_markdown", "frames_at"]

#: Lengths read, as multiples of the training clips' length.
LENGTH_FACTORS = (2, 8)
#: The streaming fine-tunes a pilot's work dir may hold, under ``runs/<name>/pipeline``.
DIAGNOSED_RUNS = ("long-mhla", "long-softmax")
#: Chunks given as oracle context, and chunks made after them (more where a judge window needs them).
ORACLE_GIVEN, ORACLE_MADE = 2, 2


def frames_at(train_frames: int, factor: int) -> int:
    """Video frames at ``factor`` times the training clips' length (17 frames: 33 at 2x, 129 at 8x)."""
    return factor * (train_frames - 1) + 1


def _encode(pipe: Any, frames: np.ndarray) -> "torch.Tensor":  # noqa: F821
    """uint8 frames ``(T, H, W, 3)`` -> the transformer's latents ``(1, C, F, h, w)`` (the posterior's mean,
    normalised as the trainer normalises it)."""
    import torch

    from ...finetune.latents import encode_posterior, wan_latent_normalization

    pixels = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)[None]
    channels = pipe.transformer.config.in_channels
    shift, scale = wan_latent_normalization(pipe.vae, channels)
    return encode_posterior(pipe.vae, pixels, shift, scale)[:, :channels]


def _length_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    drifts = [r["speed_drift"] for r in rows if r["speed_drift"] is not None]
    return {
        "videos": len(rows),
        "windows_match": windows_match(rows),
        "largest_border_jump_px": largest_of(rows, "border_jump_px"),
        "largest_inner_jump_px": largest_of(rows, "inner_jump_px"),
        "speed_drift_median": statistics.median(drifts) if drifts else None,
    }


def _inner_jump(frames: np.ndarray, starts: list[int]) -> float | None:
    """The largest centroid jump between consecutive frames of the same chunk (``None``: a frame without a shape)."""
    jumps = np.linalg.norm(np.diff(centroids(frames), axis=0), axis=1)
    inner = np.delete(jumps, [s - 1 for s in starts])
    return None if np.isnan(inner).any() else round(float(inner.max()), 4)


def _oracle(pipe: Any, judge: Any, prompt: str, index: int, seed: int, chunking: dict, common: dict) -> dict[str, Any]:
    """The oracle-context reading of one prompt (module docstring)."""
    t = pipe.geometry.vae_scale_temporal  # latent frames -> video frames
    first = chunking["first_chunk_frames"] or chunking["chunk_frames"]
    given_frames = 1 + t * (first - 1) + t * chunking["chunk_frames"] * (ORACLE_GIVEN - 1)
    window = judge.config["num_frames"]  # the made frames hold at least one judge window
    made_frames = t * chunking["chunk_frames"] * max(ORACLE_MADE, math.ceil(window / (t * chunking["chunk_frames"])))
    total = given_frames + made_frames
    real, _ = _real_video(prompt, index, total)
    context = _encode(pipe, real[:given_frames])
    frames, _ = stream_frames(pipe, prompt, total, seed, **chunking, context_latents=context, **common)
    truth, made = centroids(real), centroids(frames)
    last, before = truth[given_frames - 1], truth[given_frames - 2]
    steps = np.arange(1, made_frames + 1)[:, None]
    guesses = {"hold": np.broadcast_to(last, (made_frames, 2)), "straight_on": last + steps * (last - before)}
    target = truth[given_frames:]

    def distance(points: np.ndarray) -> float | None:
        d = np.linalg.norm(points - target, axis=1)
        return None if np.isnan(d).any() else round(float(d.mean()), 4)

    # the judge's first and last windows over the made frames
    readings = window_readings(judge, frames[given_frames:], prompt, stride=max(1, made_frames - window))
    jump = np.linalg.norm(made[given_frames] - made[given_frames - 1])  # the given frame as decoded
    return {
        "prompt": prompt,
        "seed": seed,
        "given_frames": given_frames,
        "made_frames": made_frames,
        "windows_match": sum(r.matches for r in readings) / len(readings),
        "border_jump_px": None if np.isnan(jump) else round(float(jump), 4),
        "real_border_jump_px": round(float(np.linalg.norm(truth[given_frames] - last)), 4),
        "mean_error_px": distance(made[given_frames:]),
        "guess_error_px": {name: distance(points) for name, points in guesses.items()},
    }


def _oracle_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else round(statistics.fmean(values), 4)

    return {
        "videos": len(rows),
        "windows_match": statistics.fmean(r["windows_match"] for r in rows),
        "largest_border_jump_px": None
        if any(r["border_jump_px"] is None for r in rows)
        else max(r["border_jump_px"] for r in rows),
        "mean_error_px": mean([r["mean_error_px"] for r in rows]),
        "hold_error_px": mean([r["guess_error_px"]["hold"] for r in rows]),
        "straight_on_error_px": mean([r["guess_error_px"]["straight_on"] for r in rows]),
    }


def diagnose_pilot(work: Path, s: Any, runs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Diagnose every streaming model of the pilot in ``work`` (``runs``: some of :data:`DIAGNOSED_RUNS`, default
    those it has); ``s``: its :class:`~.stream_build.StreamBuildSettings`. Returns run name -> reading, also written
    to ``<work>/diagnosis``."""
    from ...pipelines import MHLAWanStreamingPipeline

    work = Path(work)
    present = [r for r in DIAGNOSED_RUNS if (work / "runs" / r / "pipeline" / "model_index.json").is_file()]
    runs = tuple(present if runs is None else runs)
    missing = [r for r in runs if r not in present]
    if missing or not runs:
        raise FileNotFoundError(
            f"{work} holds no finished fine-tune {', '.join(missing or DIAGNOSED_RUNS)} (runs/<name>/pipeline): run "
            "the pilot's `mhla build-embedded --stream --work-dir ...` until its fine-tune stage is done"
        )
    judge = load_judge(work / "judges" / "long-video")
    prompts = evaluation_prompts(s.eval_prompts)
    common = generation_options(s)
    chunking = dict(chunk_frames=s.chunk_frames, first_chunk_frames=s.first_chunk_frames)
    folder = work / "diagnosis"
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for run in runs:
        began = time.perf_counter()
        pipe = MHLAWanStreamingPipeline.from_pretrained(work / "runs" / run / "pipeline")
        pipe.set_progress_bar_config(disable=True)
        counts = {factor: frames_at(s.train_frames, factor) for factor in LENGTH_FACTORS}
        for count in counts.values():  # each length a whole number of chunks, checked before any work
            pipe.check_stream(count, common["height"], common["width"], s.chunk_frames, "np", s.first_chunk_frames)
        rows: dict[int, list[dict[str, Any]]] = {factor: [] for factor in LENGTH_FACTORS}
        longest = max(counts.values())
        for i, prompt in enumerate(prompts):
            # a stream is causal: a shorter one with the same seed is the longest one's first frames
            video, chunk_starts = stream_frames(pipe, prompt, longest, EVAL_SEED + i, **chunking, **common)
            for factor, count in counts.items():
                frames, starts = video[:count], [t for t in chunk_starts if t < count]
                measures = measure_long_video(judge, frames, prompt, starts).to_json()
                measures.pop("windows")
                rows[factor].append({"prompt": prompt, **measures, "inner_jump_px": _inner_jump(frames, starts)})
        lengths = {
            f"{factor}x": {"frames": count, **_length_summary(rows[factor]), "rows": rows[factor]}
            for factor, count in counts.items()
        }
        oracle_rows = [_oracle(pipe, judge, p, i, EVAL_SEED + i, chunking, common) for i, p in enumerate(prompts)]
        results[run] = {
            "lengths": lengths,
            "oracle": {**_oracle_summary(oracle_rows), "rows": oracle_rows},
            "data_speed_px_per_frame": list(SPEED_RANGE),
            "seconds": round(time.perf_counter() - began, 1),
        }
        (folder / f"{run}.json").write_text(json.dumps(results[run], indent=2) + "\n")
    (folder / "diagnosis.md").write_text(diagnosis_markdown(results))
    return results


def diagnosis_markdown(results: dict[str, Any]) -> str:
    """One table row per model and length, then one per model for the oracle context."""

    def number(value: float | None, form: str = ".2f") -> str:
        return "shape lost" if value is None else format(value, form)

    lines = [
        "| model | length | windows right | largest border jump (px) | largest jump inside chunks (px) | speed drift |",
        "|---|---|---|---|---|---|",
    ]
    for run, result in results.items():
        for label, r in result["lengths"].items():
            drift = "n/a" if r["speed_drift_median"] is None else f"{r['speed_drift_median']:.2f}"
            lines.append(
                f"| {run} | {label} ({r['frames']} frames) | {r['windows_match']:.0%} | "
                f"{number(r['largest_border_jump_px'])} | {number(r['largest_inner_jump_px'])} | {drift} |"
            )
    lines += [
        "",
        "| model | oracle context: windows right | border jump (px) | mean error (px) | hold still | straight on |",
        "|---|---|---|---|---|---|",
    ]
    for run, result in results.items():
        o = result["oracle"]
        lines.append(
            f"| {run} | {o['windows_match']:.0%} | {number(o['largest_border_jump_px'])} | "
            f"{number(o['mean_error_px'])} | {number(o['hold_error_px'])} | {number(o['straight_on_error_px'])} |"
        )
    speed = next(iter(results.values()))["data_speed_px_per_frame"]
    lines.append(f"\nThe data's shapes move {speed[0]}-{speed[1]} px a frame.")
    return "\n".join(lines) + "\n"
