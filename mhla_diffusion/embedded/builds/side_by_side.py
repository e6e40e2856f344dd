"""MHLA and softmax samples of the same prompts and seeds side by side, each with what the judge reads in it.

The build draws this figure from the models it exports (``mhla build-embedded --figure PATH``); the
README shows it. Every sample is generated exactly as ``mhla text-to-video --prompt P --seed S``
generates it with the embedded defaults, so a reader can rerun any cell.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..judges.judge_reading import JudgeReader
from ..locations import embedded_defaults
from ..worlds.moving_shapes import NUM_FRAMES
from .reproduction import sample_clips

__all__ = ["FIGURE_PROMPTS", "FRAMES_SHOWN", "draw_side_by_side", "side_by_side_samples"]

#: The prompts of the figure and of the README's verdicts (one per shape, colour and direction at least once).
FIGURE_PROMPTS = ("a red circle moving left", "a blue square moving up", "a green triangle moving down")
#: Five evenly spaced frames of a clip, the first and the last among them.
FRAMES_SHOWN = tuple(round(i * (NUM_FRAMES - 1) / 4) for i in range(5))
_SCALE, _GAP, _TEXT = 2, 12, 18


def side_by_side_samples(
    models: dict[str, str | Path],
    judge: str | Path,
    prompts: Sequence[str] = FIGURE_PROMPTS,
    seed: int = 0,
    steps: int | None = None,
    guidance_scale: float | None = None,
) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Generate one clip per prompt with each model (``{"MHLA": folder, "softmax": folder}``) at the
    embedded defaults' size and ``seed``, with ``steps`` and ``guidance_scale`` (``None``: the embedded
    defaults, what the command line uses); returns ``{model: uint8 clips (P, F, H, W, 3)}`` and one
    verdict per prompt: ``{"prompt", "seed", <model>: judge reading as JSON}``."""
    from ...pipelines import MHLAWanPipeline

    d = embedded_defaults()
    steps = d.video_steps if steps is None else steps
    guidance_scale = d.video_guidance_scale if guidance_scale is None else guidance_scale
    reader = JudgeReader(judge)
    clips: dict[str, np.ndarray] = {}
    verdicts: list[dict[str, Any]] = [{"prompt": p, "seed": seed} for p in prompts]
    for name, folder in models.items():
        pipe = MHLAWanPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        # one call per prompt with generator seed ``seed``: what the command line does for each
        clips[name] = np.concatenate(
            [
                sample_clips(
                    pipe,
                    [prompt],
                    seed=seed,
                    batch_size=1,
                    num_frames=d.num_frames,
                    height=d.height,
                    width=d.width,
                    steps=steps,
                    guidance_scale=guidance_scale,
                    max_sequence_length=d.max_sequence_length,
                )[0]
                for prompt in prompts
            ]
        )
        for verdict, reading in zip(verdicts, reader.read_videos(clips[name], list(prompts))):
            verdict[name] = reading.to_json()
    return clips, verdicts


def draw_side_by_side(clips: dict[str, np.ndarray], verdicts: list[dict[str, Any]]) -> Image.Image:
    """One row per prompt, one filmstrip (frames :data:`FRAMES_SHOWN`, nearest-neighbour x2) per model,
    the judge's reading under each strip (a tick when it reads the prompt)."""
    names = list(clips)
    _, _, height, width, _ = next(iter(clips.values())).shape
    strip_w, strip_h = len(FRAMES_SHOWN) * width * _SCALE, height * _SCALE
    cell_w, row_h = strip_w + _GAP, _TEXT + strip_h + _TEXT + _GAP
    canvas = Image.new("RGB", (_GAP + cell_w * len(names), _TEXT + row_h * len(verdicts)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    for j, name in enumerate(names):
        draw.text((_GAP + j * cell_w, 2), name, fill=(0, 0, 0), font=font)
    for i, verdict in enumerate(verdicts):
        top = _TEXT + i * row_h
        draw.text((_GAP, top + 2), f'"{verdict["prompt"]}", seed {verdict["seed"]}', fill=(0, 0, 0), font=font)
        for j, name in enumerate(names):
            frames = clips[name][i][list(FRAMES_SHOWN)]
            strip = Image.fromarray(np.concatenate(list(frames), axis=1)).resize((strip_w, strip_h), Image.NEAREST)
            left = _GAP + j * cell_w
            canvas.paste(strip, (left, top + _TEXT))
            reading = verdict[name]
            mark = "ok" if reading["matches_prompt"] else "WRONG"
            draw.text(
                (left, top + _TEXT + strip_h + 2),
                f"judge: {reading['reading']} ({reading['confidence']:.2f}) {mark}",
                fill=(0, 110, 0) if reading["matches_prompt"] else (170, 0, 0),
                font=font,
            )
    return canvas
