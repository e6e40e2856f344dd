"""Score generators with the judges: prompt accuracy, FID / precision / recall on judge features, time.

One row of the reproduction table per model. Samples are drawn with fixed per-sample seeds, so two
models are compared on the same noise; time per sample is the median over batches of the
pipeline call's wall time divided by the batch size.
"""

from __future__ import annotations

import csv
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ...eval import ArrayImages, Reference, evaluate
from ...pipelines.outputs import float_to_uint8
from ..judges.image_judge import ImageJudge, predict_classes
from ..judges.judge_features import clips_to_filmstrips, judge_features
from ..judges.video_judge import VideoJudge, prompt_accuracy
from ..worlds.moving_shapes import ATTRIBUTES, NUM_COMBINATIONS, caption_for

__all__ = [
    "ScoreRow",
    "balanced_captions",
    "sample_clips",
    "sample_digits",
    "score_clips",
    "score_digits",
    "table_markdown",
    "write_table_csv",
]

#: Precision/recall neighbourhood size; small sets need a small k (ADM uses 3 on 50k images too).
PR_K = 3


@dataclass
class ScoreRow:
    """One row: a model, its per-attribute accuracy, judge-feature FID / precision / recall and time."""

    task: str
    model: str
    attention: str
    layout: str
    accuracy: dict[str, float]
    fid: float
    precision: float | None
    recall: float | None
    seconds_per_sample: float | None
    samples: int
    notes: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = {"task": self.task, "model": self.model, "attention": self.attention, "layout": self.layout}
        out.update({f"acc_{k}": round(v, 4) for k, v in self.accuracy.items()})
        out.update(
            {
                "fid": round(self.fid, 3),
                "precision": _round(self.precision),
                "recall": _round(self.recall),
                "seconds_per_sample": _round(self.seconds_per_sample, 4),
                "samples": self.samples,
                "notes": self.notes,
            }
        )
        return out


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def balanced_captions(count: int) -> tuple[list[str], np.ndarray]:
    """``count`` prompts cycling through all 48 attribute combinations, and their labels ``(count, 3)``."""
    combos = [(s, c, d) for s in ATTRIBUTES["shape"] for c in ATTRIBUTES["colour"] for d in ATTRIBUTES["direction"]]
    chosen = [combos[i % NUM_COMBINATIONS] for i in range(count)]
    captions = [caption_for(*combo) for combo in chosen]
    labels = np.array(
        [[ATTRIBUTES[name].index(v) for name, v in zip(("shape", "colour", "direction"), combo)] for combo in chosen],
        dtype=np.int64,
    ).reshape(-1, 3)
    return captions, labels


def _generators(seeds: Sequence[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


@torch.inference_mode()
def sample_clips(
    pipe,
    captions: Sequence[str],
    *,
    seed: int,
    batch_size: int,
    num_frames: int,
    height: int,
    width: int,
    steps: int,
    guidance_scale: float,
    max_sequence_length: int,
) -> tuple[np.ndarray, list[float]]:
    """uint8 clips ``(N, F, H, W, 3)`` for ``captions`` (sample ``i`` uses seed ``seed + i``) and the
    seconds per sample of each batch."""
    clips, per_sample = [], []
    for start in range(0, len(captions), batch_size):
        batch = list(captions[start : start + batch_size])
        began = time.perf_counter()
        frames = pipe(
            prompt=batch,
            negative_prompt=[""] * len(batch),
            num_frames=num_frames,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=_generators(range(seed + start, seed + start + len(batch))),
            max_sequence_length=max_sequence_length,
            output_type="np",
        ).frames
        per_sample.append((time.perf_counter() - began) / len(batch))
        clips.append(float_to_uint8(frames))
    return np.concatenate(clips), per_sample


@torch.inference_mode()
def sample_digits(
    pipe, labels: Sequence[int], *, seed: int, batch_size: int, steps: int, guidance_scale: float
) -> tuple[np.ndarray, list[float]]:
    """uint8 images ``(N, H, W, 3)`` of class ``labels`` (sample ``i`` uses seed ``seed + i``) and
    the seconds per sample of each batch."""
    images, per_sample = [], []
    for start in range(0, len(labels), batch_size):
        batch = [int(c) for c in labels[start : start + batch_size]]
        began = time.perf_counter()
        out = pipe(
            class_labels=batch,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=_generators(range(seed + start, seed + start + len(batch))),
            output_type="np",
        ).images
        per_sample.append((time.perf_counter() - began) / len(batch))
        images.append(float_to_uint8(out))
    return np.concatenate(images), per_sample


def _feature_metrics(samples: np.ndarray, reference: np.ndarray, judge: VideoJudge | ImageJudge) -> dict:
    extractor = judge_features(judge)
    k = PR_K if min(len(samples), len(reference)) > PR_K else None
    result = evaluate(
        ArrayImages(samples, name="samples"),
        Reference("real", ArrayImages(reference, name="real")),
        extractor,
        batch_size=64,
        k=k or PR_K,
        with_precision_recall=k is not None,
        progress=False,
        with_inception_score=False,  # not reported for the judges: no Inception Score, no warning about one
    )
    return result["metrics"]


def score_clips(
    clips: np.ndarray, labels: np.ndarray, reference_clips: np.ndarray, judge: VideoJudge
) -> tuple[dict[str, float], dict]:
    """Prompt accuracy per attribute (and ``all``) and judge-feature metrics against real clips."""
    accuracy = prompt_accuracy(judge, clips, labels)
    metrics = _feature_metrics(clips_to_filmstrips(clips), clips_to_filmstrips(reference_clips), judge)
    return accuracy, metrics


def score_digits(
    images: np.ndarray, labels: np.ndarray, reference_images: np.ndarray, judge: ImageJudge
) -> tuple[dict[str, float], dict]:
    """Class accuracy (``digit``) and judge-feature metrics against real held-out digits."""
    accuracy = {"digit": float((predict_classes(judge, images) == np.asarray(labels)).mean())}
    return accuracy, _feature_metrics(images, reference_images, judge)


def median_seconds(per_sample: Sequence[float]) -> float:
    return float(statistics.median(per_sample))


def write_table_csv(rows: Sequence[ScoreRow], path: str | Path) -> Path:
    """All rows as CSV (accuracy columns are the union over tasks; empty where not applicable)."""
    dicts = [row.as_dict() for row in rows]
    columns: list[str] = []
    for d in dicts:
        columns += [k for k in d if k not in columns]
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(dicts)
    return path


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}"


def table_markdown(rows: Sequence[ScoreRow]) -> str:
    """Markdown tables, one per task (accuracy in %, FID on judge features, ms per sample)."""
    parts = []
    for task in dict.fromkeys(row.task for row in rows):
        group = [row for row in rows if row.task == task]
        acc_names = list(group[0].accuracy)
        header = (
            ["model", "attention", "layout"]
            + [f"acc {n} %" for n in acc_names]
            + ["FID (judge)", "precision", "recall", "ms / sample"]
        )
        lines = [
            f"**{task}** ({group[0].samples} samples per model)",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for row in group:
            cells = (
                [row.model, row.attention, row.layout]
                + [_percent(row.accuracy.get(n)) for n in acc_names]
                + [
                    f"{row.fid:.2f}",
                    _percent(row.precision),
                    _percent(row.recall),
                    "" if row.seconds_per_sample is None else f"{1000 * row.seconds_per_sample:.0f}",
                ]
            )
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"
