"""Validation samples during training, written with the generation CLI's output helpers.

Videos (Wan) go to ``<output_dir>/validation/step-N/<i>-<prompt>.mp4``, images (DiT) to
``.../<i>-<class>.png``, each with a JSON of its settings beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from ..pipelines.outputs import plan_outputs, save_image, save_video, slugify, write_settings

__all__ = ["write_dit_samples", "write_video_samples"]


def _folder(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "validation" / f"step-{step:08d}"


def write_video_samples(
    pipeline,
    prompts: Sequence[str],
    texts: Sequence[dict[str, Any]],
    output_dir: str | Path,
    step: int,
    *,
    num_frames: int,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float,
    seed: int,
    fps: int,
) -> list[Path]:
    """One mp4 per prompt from a text-to-video pipeline fed each prompt's precomputed text arguments (``texts``:
    e.g. ``{"prompt_embeds": (1, L, D), "negative_prompt_embeds": ...}``)."""
    stems = [f"{i:02d}-{slugify(p)}" for i, p in enumerate(prompts)]
    plans = plan_outputs(_folder(output_dir, step), stems, "mp4", overwrite=True)
    written = []
    for prompt, text, plan in zip(prompts, texts, plans):
        generator = torch.Generator("cpu").manual_seed(seed)
        frames = pipeline(
            **text,
            num_frames=num_frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            output_type="np",
        ).frames[0]
        written.append(save_video(frames, plan, "mp4", fps))
        write_settings(
            plan,
            _settings(
                step,
                prompt=prompt,
                num_frames=num_frames,
                height=height,
                width=width,
                num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale,
                seed=seed,
            ),
        )
    return written


def write_dit_samples(
    pipeline,
    classes: Sequence[Any],
    output_dir: str | Path,
    step: int,
    *,
    num_inference_steps: int,
    guidance_scale: float,
    seed: int,
) -> list[Path]:
    """One png per class (id or name) from ``MHLADiTPipeline``."""
    ids = pipeline.class_ids(list(classes))
    stems = [f"{i:02d}-{slugify(str(c))}" for i, c in enumerate(classes)]
    plans = plan_outputs(_folder(output_dir, step), stems, "png", overwrite=True)
    images = pipeline(
        ids,
        guidance_scale=guidance_scale,
        num_inference_steps=num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).images
    written = []
    for image, plan, label, class_id in zip(images, plans, classes, ids):
        written.append(save_image(image, plan))
        write_settings(
            plan,
            _settings(
                step,
                class_label=str(label),
                class_id=class_id,
                num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale,
                seed=seed,
            ),
        )
    return written


def _settings(step: int, **values: Any) -> dict[str, Any]:
    return {"training_step": step, **values}
