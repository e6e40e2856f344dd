"""The settings of one ``mhla build-embedded`` build (:class:`BuildSettings`), the constants the build's stages
share (the students, the image layout, the video VAE's shape, the seeds), and which settings a rerun may still
change (those of stages that have not finished: :func:`check_settings_change`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..locations import embedded_defaults

__all__ = [
    "BuildSettings",
    "DATA_SEED",
    "EVAL_SEED",
    "IMAGE_LAYOUT",
    "REFERENCE_SEED",
    "STUDENTS",
    "VIDEO_PATCH",
    "VIDEO_VAE",
]

logger = logging.getLogger(__name__)

#: Student name -> (MHLA layers, one block (global linear attention) instead of the MHLA layout,
#: attention-transfer stage on).
STUDENTS: dict[str, tuple[str, bool, bool]] = {
    "mhla": ("all", False, True),
}
#: MHLA block layout of the digits student: 16x16 tokens -> 16 blocks of 4x4 (DiT-XL/2's layout); the video
#: student's is a setting (``BuildSettings.video_student_layout``).
IMAGE_LAYOUT = (4, 4)
#: Video VAE: 2x spatial and 2x temporal compression, 4 latent channels (9x48x48 -> 4x5x24x24).
#: Wan2.1 compresses 8x spatially and 4x in time; a VAE this small, trained for minutes on a CPU, that
#: compresses 4x spatially rounded every outline (real clips through it: shape read right 40-67 % of
#: the time), while 2x keeps the shapes. The transformer's 1x2x2 patches make 5x12x12 = 720 tokens of
#: 4x4 pixels. The outline lives at that scale: real latents average-pooled over 2x2 latent pixels keep
#: the shape (96 % read right), over 4x4 they lose it (44 %), and with 8x8-pixel tokens the teacher drew
#: round blobs (shape right about 40 % of the time after 2,000-4,000 steps).
VIDEO_VAE = {"dim_mult": [1, 2], "temperal_downsample": [True], "z_dim": 4}
VIDEO_PATCH = (1, 2, 2)
DATA_SEED, REFERENCE_SEED, EVAL_SEED = 0, 5000, 10_000


@dataclass
class BuildSettings:
    """Sizes and budgets of one build (defaults: the committed models; :meth:`smoke`: CI)."""

    train_clips: int = 960
    train_digits: int | None = None  # None: the whole training split (1438 digits)
    reference_clips: int = 480
    video_judge_steps: int = 1500
    image_judge_steps: int = 300
    vae_clips: int = 480
    video_vae_steps: int = 2000
    video_vae_batch_size: int = 8
    image_vae_steps: int = 250
    video_vae_crop_frames: int = 9
    video_vae_crop_size: int = 32
    video_layers: int = 6
    video_heads: int = 4  # of dim 32
    image_layers: int = 6
    image_heads: int = 2
    video_teacher_steps: int = 4000
    video_student_steps: int = 1200
    video_transfer_steps: int = 150
    # The paper's LePE (a depthwise 3x3x3 convolution of v over the token grid) and output gate on the video
    # student. After 1,200 steps (96 samples) plain MHLA read 95.8 % all-three-right with judge FID 120.6
    # (teacher: 100 %, 75.4), with LePE 99.0 % and 98.0, with LePE and gate 99.0 % and 93.8. The digits
    # student matches its teacher without them.
    # The video student's MHLA block layout on its 5x12x12 token grid: 1x6x6 = 36 blocks of 5x2x2 tokens, each
    # spanning the clip in time. In trials on the first 192 evaluation clips (from the committed teacher, 1,200
    # steps, LePE and gate; one such trial: ``mhla build-embedded --from-build mhla_diffusion/embedded/models
    # --no-export --set eval_clips=192 --set video_student_layout=1,4,4``) 1x4x4 (16 blocks of 5x3x3) scored
    # judge FID 82.7 (1.19x the teacher's), 1x6x6 79.5 (1.15x).
    video_student_layout: list[int] = field(default_factory=lambda: [1, 6, 6])
    video_student_lepe: bool = True
    video_student_gate: bool = True
    # The video student's end-to-end loss: (1 - w) x flow matching + w x the error to its softmax teacher's
    # prediction (the trainer's distillation_weight); and the EMA decay of its weights (0 = none).
    video_student_distillation: float = 0.0
    video_student_ema: float = 0.0
    video_batch_size: int = 8
    # Flow-matching shift of the video model's training noise levels and of its sampler. A flat-coloured shape
    # stays visible in a clip's frames of noise up to sigma ~0.95, so where it goes is decided above that; with
    # Wan's shift 3 few training steps land there and the teacher left direction to the noise (40 % right
    # after 2,000 steps), with 12 it followed the caption (92 %).
    video_flow_shift: float = 12.0
    image_teacher_steps: int = 3000
    image_student_steps: int = 400
    image_transfer_steps: int = 150
    image_batch_size: int = 32
    teacher_lr: float = 7e-4
    student_lr: float = 2e-4
    # 480 clips: in a trial outside the build, five disjoint sets of 96 clips of one model scored judge FID
    # 85.5 to 107.7
    eval_clips: int = 480
    eval_images: int = 250
    eval_batch_size: int = 16
    video_sample_steps: int = embedded_defaults().video_steps
    image_sample_steps: int = embedded_defaults().image_steps
    video_guidance_scale: float = embedded_defaults().video_guidance_scale
    image_guidance_scale: float = embedded_defaults().image_guidance_scale
    checkpoint_every: int = 100  # steps between checkpoints of every training inside a stage
    seed: int = 0

    @classmethod
    def smoke(cls) -> "BuildSettings":
        return cls(
            train_clips=16,
            train_digits=20,
            reference_clips=8,
            video_judge_steps=2,
            image_judge_steps=2,
            vae_clips=8,
            video_vae_steps=2,
            video_vae_batch_size=2,
            image_vae_steps=2,
            video_layers=3,
            image_layers=3,
            video_teacher_steps=2,
            video_student_steps=1,
            video_transfer_steps=1,
            video_batch_size=2,
            image_teacher_steps=2,
            image_student_steps=1,
            image_transfer_steps=1,
            image_batch_size=4,
            eval_clips=4,
            eval_images=6,
            eval_batch_size=4,
            video_sample_steps=2,
            image_sample_steps=2,
            checkpoint_every=1,
        )


# ---------------------------------------------------------------------------- settings

#: The first stage that uses each setting; the others' default: ``data``.
FIRST_STAGE = {
    **dict.fromkeys(["reference_clips", "video_judge_steps", "image_judge_steps"], "judges"),
    **dict.fromkeys(
        [
            "vae_clips",
            "video_vae_steps",
            "video_vae_batch_size",
            "video_vae_crop_frames",
            "video_vae_crop_size",
            "image_vae_steps",
        ],
        "autoencoders",
    ),
    **dict.fromkeys(["video_layers", "video_heads", "image_layers", "image_heads", "video_flow_shift"], "base"),
    **dict.fromkeys(
        ["video_teacher_steps", "image_teacher_steps", "video_batch_size", "image_batch_size", "teacher_lr"], "teachers"
    ),
    **dict.fromkeys(
        [
            "video_student_steps",
            "video_transfer_steps",
            "video_student_layout",
            "video_student_lepe",
            "video_student_gate",
            "video_student_distillation",
            "video_student_ema",
            "image_student_steps",
            "image_transfer_steps",
            "student_lr",
        ],
        "students",
    ),
    **dict.fromkeys(
        [
            "eval_clips",
            "eval_images",
            "eval_batch_size",
            "video_sample_steps",
            "image_sample_steps",
            "video_guidance_scale",
            "image_guidance_scale",
        ],
        "evaluate",
    ),
}


def check_settings_change(
    work: Path, before: dict[str, Any], after: dict[str, Any], first_stage: Callable[[str], str] | None = None
) -> None:
    """A rerun may change the settings of stages that have not finished yet (a longer teacher budget, say,
    while the VAE is still training); changing what a finished stage was built with is refused.
    ``checkpoint_every`` may always change. ``first_stage(setting)``: the first stage that reads a setting
    (default: this build's :data:`FIRST_STAGE`; the streaming build passes its own)."""
    changed = changed_settings(before, after)
    if not changed:
        return
    if first_stage is None:
        first_stage = lambda k: FIRST_STAGE.get(k, "data")  # noqa: E731
    done = [k for k in changed if (work / "stages" / f"{first_stage(k)}.json").is_file()]
    if done:
        raise ValueError(
            f"{work} holds a build with other settings ({work / 'settings.json'}): "
            f"{describe_changes(done, before, after)} would change stages that have "
            "already finished; use another --work-dir or delete that folder"
        )
    logger.info("settings changed for stages not finished yet: %s", describe_changes(changed, before, after))


def changed_settings(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The settings ``after`` gives another value than ``before`` (``checkpoint_every`` never counts)."""
    return sorted(k for k in after if before.get(k) != after[k] and k != "checkpoint_every")


def describe_changes(keys: list[str], before: dict[str, Any], after: dict[str, Any]) -> str:
    return ", ".join(f"{k} {before.get(k)} -> {after[k]}" for k in keys)
