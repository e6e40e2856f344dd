"""What the embedded judges read in one generated sample, with their confidence: "judge: red circle, moving left".

The command line writes it into the JSON beside each sample of an embedded model and the web demo
shows it under each sample, so a viewer can check a side-by-side MHLA / softmax comparison against
a classifier that never saw a generative model (:mod:`.video_judge`, :mod:`.image_judge`).

A reading's confidence is the judge's softmax probability of what it read: per attribute for a
video (shape, colour, direction) and, for the whole reading, their product (the three heads read one
clip independently); the class probability for a digit. The prompt's own words say what was asked:
an attribute value named in the prompt (exactly one of its kind) is compared with the reading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ...pipelines.outputs import float_to_uint8
from ..worlds.moving_shapes import ATTRIBUTES
from .image_judge import ImageJudge, images_to_tensor
from .judge_io import load_judge
from .video_judge import VideoJudge, clips_to_tensor

__all__ = ["ImageReading", "JudgeReader", "VideoReading", "requested_attributes"]


def requested_attributes(prompt: str) -> dict[str, str]:
    """The attribute values ``prompt`` asks for: each attribute of which it names exactly one value
    (``"a red circle moving left"`` -> shape circle, colour red, direction left; ``"a cat"`` -> ``{}``)."""
    words = set(re.findall(r"[a-z]+", prompt.lower()))
    requested = {}
    for name, values in ATTRIBUTES.items():
        named = [value for value in values if value in words]
        if len(named) == 1:
            requested[name] = named[0]
    return requested


@dataclass(frozen=True)
class VideoReading:
    """The video judge's reading of one clip: per attribute the value it read and its probability."""

    values: dict[str, str]
    confidences: dict[str, float]
    requested: dict[str, str]

    @property
    def confidence(self) -> float:
        """The probability of the whole reading (the product of the attributes')."""
        return float(np.prod(list(self.confidences.values())))

    @property
    def text(self) -> str:
        """``"red circle, moving left"``."""
        return f"{self.values['colour']} {self.values['shape']}, moving {self.values['direction']}"

    @property
    def matches(self) -> bool | None:
        """Whether every attribute the prompt names was read as named (``None``: the prompt names none)."""
        if not self.requested:
            return None
        return all(self.values[name] == value for name, value in self.requested.items())

    def describe(self) -> str:
        """One line: ``judge: red circle, moving left (confidence 0.85: shape 0.97, colour 1.00, direction 0.88)``."""
        parts = ", ".join(f"{name} {self.confidences[name]:.2f}" for name in ATTRIBUTES)
        return f"judge: {self.text} (confidence {self.confidence:.2f}: {parts})"

    def to_json(self) -> dict[str, Any]:
        """The reading for a JSON file."""
        return {
            "reading": self.text,
            "confidence": round(self.confidence, 4),
            **{
                name: {"value": self.values[name], "confidence": round(self.confidences[name], 4)}
                for name in ATTRIBUTES
            },
            "requested": self.requested,
            "matches_prompt": self.matches,
        }


@dataclass(frozen=True)
class ImageReading:
    """The image judge's reading of one image: the class it read, its probability and the class asked for."""

    class_id: int
    label: str
    confidence: float
    requested_id: int | None

    @property
    def matches(self) -> bool | None:
        """Whether the judge read the class that was asked for (``None``: none was)."""
        return None if self.requested_id is None else self.class_id == self.requested_id

    def describe(self) -> str:
        """One line: ``judge: 7 (confidence 0.99)``."""
        return f"judge: {self.label} (confidence {self.confidence:.2f})"

    def to_json(self) -> dict[str, Any]:
        return {
            "reading": self.label,
            "class_id": self.class_id,
            "confidence": round(self.confidence, 4),
            "requested_class_id": self.requested_id,
            "matches_class": self.matches,
        }


class JudgeReader:
    """A loaded judge (video or image) that reads generated samples; ``folder``: a saved judge."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.judge: VideoJudge | ImageJudge = load_judge(folder)

    @property
    def kind(self) -> str:
        """``"video"`` or ``"image"``."""
        return self.judge.kind

    def unreadable(self, shape: Sequence[int]) -> str | None:
        """Why the judge cannot read samples of ``shape`` (one video ``(F, H, W, 3)`` or image ``(H, W, 3)``),
        or ``None`` when it can: it reads only the size it was trained on."""
        c = self.judge.config
        if self.kind == "video":
            wanted = (c["num_frames"], c["frame_size"], c["frame_size"], 3)
            what = f"{c['num_frames']}-frame {c['frame_size']}x{c['frame_size']} clips"
        else:
            wanted = (c["image_size"], c["image_size"], 3)
            what = f"{c['image_size']}x{c['image_size']} images"
        if tuple(shape) != wanted:
            return f"the judge reads {what}, not {'x'.join(map(str, shape[:-1]))}"
        return None

    @torch.inference_mode()
    def read_videos(self, clips: np.ndarray, prompts: Sequence[str]) -> list[VideoReading]:
        """Readings of ``clips`` ``(N, F, H, W, 3)`` (uint8, or floats in [0, 1]) generated for ``prompts``."""
        if self.kind != "video":
            raise ValueError(f"{self.folder} is an image judge; read_videos needs the video judge")
        clips = float_to_uint8(clips)  # what the output writers save: the judge reads what users see
        if len(clips) != len(prompts):
            raise ValueError(f"got {len(clips)} clips but {len(prompts)} prompts")
        why = self.unreadable(clips.shape[1:]) if len(clips) else None
        if why:
            raise ValueError(why)
        logits = self.judge.eval()(clips_to_tensor(clips)) if len(clips) else {}
        readings = []
        for i, prompt in enumerate(prompts):
            values, confidences = {}, {}
            for name, options in ATTRIBUTES.items():
                probabilities = logits[name][i].softmax(-1)
                best = int(probabilities.argmax())
                values[name], confidences[name] = options[best], float(probabilities[best])
            readings.append(VideoReading(values, confidences, requested_attributes(prompt)))
        return readings

    @torch.inference_mode()
    def read_images(
        self, images: np.ndarray, requested: Sequence[int | None], labels: dict[int, str] | None = None
    ) -> list[ImageReading]:
        """Readings of ``images`` ``(N, H, W, 3)`` (uint8, or floats in [0, 1]) generated for the class ids
        ``requested``; ``labels`` names the classes (default: the id as text)."""
        if self.kind != "image":
            raise ValueError(f"{self.folder} is a video judge; read_images needs the image judge")
        images = float_to_uint8(images)
        if len(images) != len(requested):
            raise ValueError(f"got {len(images)} images but {len(requested)} requested classes")
        why = self.unreadable(images.shape[1:]) if len(images) else None
        if why:
            raise ValueError(why)
        if not len(images):
            return []
        probabilities = self.judge.eval()(images_to_tensor(images)).softmax(-1)
        readings = []
        for row, wanted in zip(probabilities, requested):
            best = int(row.argmax())
            label = (labels or {}).get(best, str(best))
            readings.append(ImageReading(best, label, float(row[best]), None if wanted is None else int(wanted)))
        return readings
