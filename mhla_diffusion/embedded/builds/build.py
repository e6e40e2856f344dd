"""``mhla build-embedded``: train the embedded demonstration models from scratch and reproduce the
paper's claim at toy scale, with this project's own data, trainers and evaluator.

Stages (each writes into ``--work-dir`` and is skipped when a rerun finds it finished):

1. ``data``: moving-shapes clips (a GIF folder for the Wan trainer) and the digits split;
2. ``judges``: the video and image classifiers (trained on generator ground truth only);
3. ``autoencoders``: the tiny Wan VAE and the tiny KL VAE;
4. ``base``: pipeline folders with a randomly initialised transformer, the trained VAE, a random
   frozen UMT5 text encoder (as Wan keeps its encoder frozen) and a tokenizer built here;
5. ``teachers``: softmax teachers trained by ``finetune/train_wan`` / ``train_dit`` (``attention: softmax``);
6. ``students``: the conversion of each teacher to MHLA (all layers), fine-tuned with the same trainer
   after attention transfer (``STUDENTS`` holds other conversions a build may add; the comparison of
   attentions trained from scratch is the reproduction experiment's job);
7. ``evaluate``: samples of every model scored by the judges -> ``reproduction.csv`` / ``.md``;
   and the side-by-side figure of MHLA and softmax samples (:mod:`.side_by_side`) with the judge's verdicts;
8. ``export``: teachers, MHLA students and judges copied to ``--output`` (default: the package's
   ``mhla_diffusion/embedded/models``), plus ``build_report.json`` (and the figure to ``--figure``).

A stage killed part-way resumes from its last checkpoint inside the stage on the next run (judges,
VAEs and trainers save every ``checkpoint_every`` steps; the evaluation keeps each scored model).

``--from-build DIR`` starts a new work dir from the judges, VAEs and teachers of a build exported to
``DIR`` (:func:`_start_from_build`): new student or evaluation settings without training the rest again.

``--smoke`` runs every stage with a handful of steps and samples (the CI check of this command).
The command line is :mod:`mhla_diffusion.cli.build_embedded`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from ...training.loop import LoopProgress
from ...training.stages import Stages
from ..judges.image_judge import class_accuracy, train_image_judge
from ..judges.judge_io import load_judge, save_judge
from ..judges.video_judge import prompt_accuracy, train_video_judge
from ..locations import embedded_defaults, weight_hashes
from ..worlds.digits import DIGIT_SIZE, split_digits, write_digits_folder
from ..worlds.moving_shapes import ATTRIBUTES, generate_clips
from ..worlds.shapes_dataset import write_shapes_dataset
from .autoencoders import (
    psnr,
    reconstruct_clips,
    reconstruct_images,
    tiny_image_vae,
    tiny_video_vae,
    train_image_vae,
    train_video_vae,
)
from .build_settings import (
    DATA_SEED,
    EVAL_SEED,
    FIRST_STAGE,
    IMAGE_LAYOUT,
    REFERENCE_SEED,
    STUDENTS,
    VIDEO_PATCH,
    VIDEO_VAE,
    BuildSettings,
    changed_settings,
    check_settings_change,
    describe_changes,
)
from .reproduction import (
    ScoreRow,
    balanced_captions,
    median_seconds,
    sample_clips,
    sample_digits,
    score_clips,
    score_digits,
    table_markdown,
    write_table_csv,
)
from .side_by_side import draw_side_by_side, side_by_side_samples

__all__ = ["build_demo_models"]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- stages


#: Where a stage writes while it runs (the time of an attempt killed without warning ends at its last write there).
_WATCHED = ("checkpoints", "runs", "cache", "evaluate", "judges", "autoencoders", "base", "data")

#: ``on_step(part, step)`` of the running build (tests interrupt a build with it), set by :func:`build_demo_models`.
_ON_STEP: Callable[[str, int], None] | None = None


def _progress(work: Path, s: BuildSettings, part: str) -> LoopProgress:
    """Bar and checkpoint file of one judge / VAE training inside a stage."""
    hook = _ON_STEP
    return LoopProgress(
        checkpoint=work / "checkpoints" / f"{part}.pt",
        every=s.checkpoint_every,
        show=True,
        on_step=None if hook is None else (lambda step: hook(part, step)),
    )


def _data(work: Path, s: BuildSettings) -> dict[str, Any]:
    write_shapes_dataset(work / "data" / "shapes", s.train_clips, seed=DATA_SEED, overwrite=True)
    split = split_digits(seed=s.seed)
    keep = slice(0, s.train_digits)
    write_digits_folder(
        work / "data" / "digits",
        split.train_images[keep],
        split.train_labels[keep],
        overwrite=True,
        indices=split.train_indices[keep],
    )
    return {
        "train_clips": s.train_clips,
        "train_digits": int(len(split.train_images[keep])),
        "held_out_digits": int(len(split.test_images)),
    }


def _judges(work: Path, s: BuildSettings) -> dict[str, Any]:
    video = train_video_judge(steps=s.video_judge_steps, seed=s.seed, progress=_progress(work, s, "video-judge"))
    held_clips, held_labels, _ = generate_clips(s.reference_clips, seed=REFERENCE_SEED)
    video_acc = prompt_accuracy(video, held_clips, held_labels)
    split = split_digits(seed=s.seed)
    image = train_image_judge(
        split.train_images,
        split.train_labels,
        steps=s.image_judge_steps,
        seed=s.seed,
        progress=_progress(work, s, "image-judge"),
    )
    image_acc = class_accuracy(image, split.test_images, split.test_labels)
    save_judge(video, work / "judges" / "video", metadata={"held_out_accuracy": video_acc}, overwrite=True)
    save_judge(image, work / "judges" / "image", metadata={"held_out_accuracy": image_acc}, overwrite=True)
    return {
        "video_held_out_accuracy": video_acc,
        "image_held_out_accuracy": image_acc,
        "video_held_out_clips": s.reference_clips,
        "image_held_out_digits": int(len(split.test_images)),
    }


def _autoencoders(work: Path, s: BuildSettings) -> dict[str, Any]:
    clips, _, _ = generate_clips(s.vae_clips, seed=DATA_SEED + 1)
    video_vae = tiny_video_vae(seed=s.seed, **VIDEO_VAE)
    video_losses = train_video_vae(
        video_vae,
        clips,
        steps=s.video_vae_steps,
        batch_size=s.video_vae_batch_size,
        seed=s.seed,
        crop_frames=s.video_vae_crop_frames,
        crop_size=s.video_vae_crop_size,
        progress=_progress(work, s, "video-vae"),
    )
    video_vae.save_pretrained(work / "autoencoders" / "video")
    split = split_digits(seed=s.seed)
    image_vae = tiny_image_vae(seed=s.seed)
    image_losses = train_image_vae(
        image_vae,
        split.train_images[: s.train_digits],
        steps=s.image_vae_steps,
        seed=s.seed,
        progress=_progress(work, s, "image-vae"),
    )
    image_vae.save_pretrained(work / "autoencoders" / "image")
    return {
        "video_final_loss": float(np.mean(video_losses[-20:])),
        "image_final_loss": float(np.mean(image_losses[-20:])),
    }


def _caption_words() -> list[str]:
    return ["a", "moving", *ATTRIBUTES["shape"], *ATTRIBUTES["colour"], *ATTRIBUTES["direction"]]


def _base(work: Path, s: BuildSettings) -> dict[str, Any]:
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLWan,
        DDIMScheduler,
        DiTPipeline,
        UniPCMultistepScheduler,
        WanPipeline,
    )

    from ...models.tiny import tiny_dit_transformer, tiny_text_encoder, tiny_tokenizer, tiny_wan_transformer
    from ...utils.geometry import ImageGeometry
    from ...utils.model_defaults import RECORD_KEY, checked_record

    vae = AutoencoderKLWan.from_pretrained(work / "autoencoders" / "video")
    tokenizer = tiny_tokenizer(_caption_words())
    text_encoder = tiny_text_encoder(len(tokenizer), seed=s.seed)
    transformer = tiny_wan_transformer(
        num_layers=s.video_layers,
        seed=s.seed,
        patch_size=VIDEO_PATCH,
        num_attention_heads=s.video_heads,
        attention_head_dim=32,
        in_channels=vae.config.z_dim,
        out_channels=vae.config.z_dim,
        text_dim=text_encoder.config.d_model,
        ffn_dim=256,
        rope_max_seq_len=64,
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=s.video_flow_shift
    )
    video = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    d = embedded_defaults()
    # the settings the models are trained and evaluated with: the trainers' saved pipelines keep what they do not
    # train (steps, fps, guidance), so the exported folders record them
    video_record = dict(
        num_frames=d.num_frames,
        height=d.height,
        width=d.width,
        num_inference_steps=s.video_sample_steps,
        guidance_scale=s.video_guidance_scale,
        fps=d.fps,
        max_sequence_length=d.max_sequence_length,
    )
    video.register_to_config(**{RECORD_KEY: checked_record(video_record, True, "the video base pipeline")})
    video.save_pretrained(work / "base" / "shapes-t2v")

    image_vae = AutoencoderKL.from_pretrained(work / "autoencoders" / "image")
    latent_side = DIGIT_SIZE // ImageGeometry.from_configs(vae=image_vae.config).vae_scale
    dit = tiny_dit_transformer(
        num_layers=s.image_layers,
        seed=s.seed,
        num_attention_heads=s.image_heads,
        attention_head_dim=32,
        in_channels=image_vae.config.latent_channels,
        out_channels=2 * image_vae.config.latent_channels,
        sample_size=latent_side,
        patch_size=1,
        num_embeds_ada_norm=10,
    )
    ddim = DDIMScheduler(
        num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02, clip_sample=False
    )
    id2label = {i: str(i) for i in range(10)}
    pipe = DiTPipeline(transformer=dit, vae=image_vae, scheduler=ddim, id2label=id2label)
    pipe.register_to_config(id2label=id2label)
    image_record = dict(num_inference_steps=s.image_sample_steps, guidance_scale=s.image_guidance_scale)
    pipe.register_to_config(**{RECORD_KEY: checked_record(image_record, False, "the image base pipeline")})
    pipe.save_pretrained(work / "base" / "digits-c2i")
    count = lambda m: int(sum(p.numel() for p in m.parameters()))  # noqa: E731
    return {
        "video_transformer_params": count(transformer),
        "image_transformer_params": count(dit),
        "text_encoder_params": count(text_encoder),
    }


@dataclass(frozen=True)
class _Run:
    """One trainer run of a stage: its name (``softmax`` or a :data:`STUDENTS` key), the pipeline it starts
    from, its steps and learning rate, softmax (``mhla`` None) or the MHLA options, and its attention-transfer steps."""

    name: str
    pretrained: Path
    steps: int
    lr: float
    mhla: dict[str, Any] | None = None
    transfer: int = 0


def _run_values(work: Path, s: BuildSettings, task: str, data: str, run: _Run) -> dict[str, Any]:
    """Trainer options both tasks share: the run folder ``runs/{task}-{run.name}``, the budget, and softmax or MHLA."""
    from ...finetune.checkpointing import list_checkpoints

    folder = work / "runs" / f"{task}-{run.name}"
    resume = bool(list_checkpoints(folder))  # a run this stage started before it was killed
    values = dict(
        output_dir=str(folder),
        overwrite_output_dir=not resume,
        resume="latest" if resume else None,
        seed=s.seed,
        mixed_precision="no",
        gradient_checkpointing=False,
        report_to="none",
        checkpointing_steps=s.checkpoint_every,
        checkpoints_total_limit=1,
        save_pipeline=True,
        max_grad_norm=1.0,
        lr_scheduler="constant_with_warmup",
        lr_warmup_steps=min(100, run.steps // 10),
        dataloader_num_workers=0,
        max_train_steps=run.steps,
        pretrained_model=str(run.pretrained),
        data_dir=str(work / "data" / data),
        cache_latents=True,
        cache_dir=str(work / "cache" / data),
        learning_rate=run.lr,
        attention_transfer_steps=run.transfer,
    )
    if run.mhla is None:
        values["attention"] = "softmax"
    else:
        values["mhla"] = run.mhla
    return values


def _video_options(
    work: Path, s: BuildSettings, run: _Run, distillation: float = 0.0, ema: float = 0.0
) -> "WanTrainOptions":  # noqa: F821
    from ...finetune.options import WanTrainOptions, options_from_dict

    d = embedded_defaults()
    values = _run_values(work, s, "t2v", "shapes", run)
    values.update(
        height=d.height,
        width=d.width,
        num_frames=d.num_frames,
        max_sequence_length=d.max_sequence_length,
        caption_dropout=0.1,
        train_batch_size=s.video_batch_size,
        flow_shift=s.video_flow_shift,
        distillation_weight=distillation,
        ema_decay=ema,
        ema_warmup=ema > 0,
    )
    return options_from_dict(WanTrainOptions, values)


def _image_options(work: Path, s: BuildSettings, run: _Run) -> "DiTTrainOptions":  # noqa: F821
    from ...finetune.options import DiTTrainOptions, options_from_dict

    values = _run_values(work, s, "c2i", "digits", run)
    values.update(
        resolution=32, random_flip=False, class_dropout=0.1, ema_decay=0.0, train_batch_size=s.image_batch_size
    )
    return options_from_dict(DiTTrainOptions, values)


def _train_run(work: Path, train: Callable, options) -> float | None:
    """One trainer run inside a stage: skipped when an earlier attempt finished it, resumed from its last
    checkpoint when one was killed part-way (:func:`_run_values`). Returns the seconds of the attempt that
    finished it (``None``: not known, the run was resumed)."""
    folder = Path(options.output_dir)
    done = folder / "build-done.json"
    if done.is_file():
        logger.info("run %s: already done", folder.name)
        return json.loads(done.read_text())["seconds"]
    hook = _ON_STEP
    began = time.perf_counter()
    train(options, on_step_end=None if hook is None else (lambda step, logs: hook(folder.name, step)))
    seconds = None if options.resume else round(time.perf_counter() - began, 1)
    done.write_text(json.dumps({"seconds": seconds}))
    return seconds


def _student_mhla(name: str, layout: tuple[int, ...], lepe: bool = False, gate: bool = False) -> dict[str, Any]:
    layers, one_block, _ = STUDENTS[name]
    return {"layers": layers, "layout": [1] * len(layout) if one_block else list(layout), "lepe": lepe, "gate": gate}


def _teachers(work: Path, s: BuildSettings) -> dict[str, Any]:
    from ...finetune.train_dit import train as train_dit
    from ...finetune.train_wan import train as train_wan

    seconds = {}
    seconds["t2v-softmax"] = _train_run(
        work,
        train_wan,
        _video_options(work, s, _Run("softmax", work / "base" / "shapes-t2v", s.video_teacher_steps, s.teacher_lr)),
    )
    seconds["c2i-softmax"] = _train_run(
        work,
        train_dit,
        _image_options(work, s, _Run("softmax", work / "base" / "digits-c2i", s.image_teacher_steps, s.teacher_lr)),
    )
    return {"seconds_per_run": seconds, "video_steps": s.video_teacher_steps, "image_steps": s.image_teacher_steps}


def _students(work: Path, s: BuildSettings) -> dict[str, Any]:
    from ...finetune.train_dit import train as train_dit
    from ...finetune.train_wan import train as train_wan

    seconds: dict[str, float | None] = {}
    for name, (_, _, transfer) in STUDENTS.items():
        seconds[f"t2v-{name}"] = _train_run(
            work,
            train_wan,
            _video_options(
                work,
                s,
                _Run(
                    name,
                    work / "runs" / "t2v-softmax" / "pipeline",
                    s.video_student_steps,
                    s.student_lr,
                    _student_mhla(name, tuple(s.video_student_layout), s.video_student_lepe, s.video_student_gate),
                    s.video_transfer_steps if transfer else 0,
                ),
                s.video_student_distillation,
                s.video_student_ema,
            ),
        )
        seconds[f"c2i-{name}"] = _train_run(
            work,
            train_dit,
            _image_options(
                work,
                s,
                _Run(
                    name,
                    work / "runs" / "c2i-softmax" / "pipeline",
                    s.image_student_steps,
                    s.student_lr,
                    _student_mhla(name, IMAGE_LAYOUT),
                    s.image_transfer_steps if transfer else 0,
                ),
            ),
        )
    return {
        "seconds_per_run": seconds,
        "video_steps": s.video_student_steps,
        "image_steps": s.image_student_steps,
        "video_transfer_steps": s.video_transfer_steps,
        "image_transfer_steps": s.image_transfer_steps,
    }


def _attention_and_layout(pipe) -> tuple[str, str]:
    """The attention (``softmax``, ``MHLA`` or ``MHLA + LePE + gate``) and block layout (``1x6x6``, with
    ``(k/n layers)`` when only some layers are converted, ``-`` for softmax), read from the model, not from
    its run's name."""
    from ...models.conversion import get_mhla_conversion

    conversion = get_mhla_conversion(pipe.transformer)
    if conversion is None:
        return "softmax", "-"
    config = conversion.config
    attention = " + ".join(["MHLA", *(["LePE"] if config.lepe else []), *(["gate"] if config.gate else [])])
    layers, total = len(conversion.layer_names), conversion.num_layers
    layout = "x".join(map(str, conversion.layout)) + ("" if layers == total else f" ({layers}/{total} layers)")
    return attention, layout


def _row(
    task: str,
    model: str,
    scored: tuple[dict[str, float], dict],
    count: int,
    attention: str = "-",
    layout: str = "-",
    seconds: float | None = None,
    notes: str = "",
) -> ScoreRow:
    """A table row from ``(accuracy, judge-feature metrics)``."""
    accuracy, metrics = scored
    return ScoreRow(
        task,
        model,
        attention,
        layout,
        accuracy,
        metrics["fid"],
        metrics["precision"],
        metrics["recall"],
        seconds,
        count,
        notes,
    )


def _model_rows(
    work: Path, task: str, prefix: str, pipeline_cls: type, sample: Callable, score: Callable, count: int
) -> list[ScoreRow]:
    """One row per trained model (teacher and students): ``sample(pipe) -> (samples, seconds per sample
    of each batch)``, ``score(samples) -> (accuracy, metrics)``."""
    rows = []
    for name in tqdm(["softmax", *STUDENTS], desc=f"evaluate {task}", unit="model", dynamic_ncols=True):
        scored = work / "evaluate" / f"{prefix}-{name}.json"  # a killed evaluation keeps the models it scored
        if not scored.is_file():
            pipe = pipeline_cls.from_pretrained(work / "runs" / f"{prefix}-{name}" / "pipeline")
            pipe.set_progress_bar_config(disable=True)
            samples, times = sample(pipe)
            accuracy, metrics = score(samples)
            scored.parent.mkdir(parents=True, exist_ok=True)
            attention, layout = _attention_and_layout(pipe)
            scored.write_text(
                json.dumps(
                    {
                        "accuracy": accuracy,
                        "metrics": metrics,
                        "layout": layout,
                        "attention": attention,
                        "seconds": median_seconds(times),
                    }
                )
            )
        saved = json.loads(scored.read_text())
        rows.append(
            _row(
                task,
                _model_name(name),
                (saved["accuracy"], saved["metrics"]),
                count,
                saved["attention"],
                saved["layout"],
                saved["seconds"],
            )
        )
    return rows


_VAE_CEILING = "the best any generator with this VAE can do"


def _evaluate(work: Path, s: BuildSettings) -> dict[str, Any]:
    from diffusers import AutoencoderKL, AutoencoderKLWan

    from ...pipelines import MHLADiTPipeline, MHLAWanPipeline

    d = embedded_defaults()
    video_judge, image_judge = load_judge(work / "judges" / "video"), load_judge(work / "judges" / "image")
    reference_clips, _, _ = generate_clips(s.reference_clips, seed=REFERENCE_SEED)
    split = split_digits(seed=s.seed)
    captions, labels = balanced_captions(s.eval_clips)
    digit_labels = np.arange(s.eval_images) % 10
    real_clips, real_labels, _ = generate_clips(s.eval_clips, seed=EVAL_SEED)
    real_digits, real_digit_labels = split.train_images[: s.eval_images], split.train_labels[: s.eval_images]

    def score_video(clips: np.ndarray, attributes: np.ndarray = labels):
        return score_clips(clips, attributes, reference_clips, video_judge)

    def score_image(images: np.ndarray, classes: np.ndarray = digit_labels):
        return score_digits(images, classes, split.test_images, image_judge)

    with torch.no_grad():
        video_vae = AutoencoderKLWan.from_pretrained(work / "autoencoders" / "video").eval()
        image_vae = AutoencoderKL.from_pretrained(work / "autoencoders" / "image").eval()
        video_through_vae = reconstruct_clips(video_vae, real_clips)
        digits_through_vae = reconstruct_images(image_vae, real_digits)
        rows = [
            _row(
                "text-to-video",
                "real clips (held out)",
                score_video(real_clips, real_labels),
                s.eval_clips,
                notes="the data itself",
            ),
            _row(
                "text-to-video",
                "real clips through the VAE",
                score_video(video_through_vae, real_labels),
                s.eval_clips,
                notes=f"{_VAE_CEILING}; PSNR {psnr(real_clips, video_through_vae):.1f} dB",
            ),
            *_model_rows(
                work,
                "text-to-video",
                "t2v",
                MHLAWanPipeline,
                lambda pipe: sample_clips(
                    pipe,
                    captions,
                    seed=EVAL_SEED,
                    batch_size=s.eval_batch_size,
                    num_frames=d.num_frames,
                    height=d.height,
                    width=d.width,
                    steps=s.video_sample_steps,
                    guidance_scale=s.video_guidance_scale,
                    max_sequence_length=d.max_sequence_length,
                ),
                score_video,
                s.eval_clips,
            ),
            _row(
                "class-to-image",
                "real digits (training set)",
                score_image(real_digits, real_digit_labels),
                s.eval_images,
                notes="the data itself",
            ),
            _row(
                "class-to-image",
                "real digits through the VAE",
                score_image(digits_through_vae, real_digit_labels),
                s.eval_images,
                notes=f"{_VAE_CEILING}; PSNR {psnr(real_digits, digits_through_vae):.1f} dB",
            ),
            *_model_rows(
                work,
                "class-to-image",
                "c2i",
                MHLADiTPipeline,
                lambda pipe: sample_digits(
                    pipe,
                    digit_labels,
                    seed=EVAL_SEED,
                    batch_size=4 * s.eval_batch_size,
                    steps=s.image_sample_steps,
                    guidance_scale=s.image_guidance_scale,
                ),
                score_image,
                s.eval_images,
            ),
        ]
    write_table_csv(rows, work / "reproduction.csv")
    (work / "reproduction.md").write_text(table_markdown(rows))
    clips, verdicts = side_by_side_samples(
        {"MHLA": work / "runs" / "t2v-mhla" / "pipeline", "softmax": work / "runs" / "t2v-softmax" / "pipeline"},
        work / "judges" / "video",
        steps=s.video_sample_steps,
        guidance_scale=s.video_guidance_scale,
    )
    draw_side_by_side(clips, verdicts).save(work / "side-by-side.png")
    return {"rows": [row.as_dict() for row in rows], "verdicts": verdicts}


def _model_name(name: str) -> str:
    return {"softmax": "softmax teacher", "mhla": "MHLA (all layers)"}[name]


def _export(work: Path, output: Path, s: BuildSettings, report: dict[str, Any], figure: Path | None) -> dict[str, Any]:
    output.mkdir(parents=True, exist_ok=True)
    pairs = {
        "shapes-t2v-softmax": "t2v-softmax",
        "shapes-t2v-mhla": "t2v-mhla",
        "digits-c2i-softmax": "c2i-softmax",
        "digits-c2i-mhla": "c2i-mhla",
    }
    for target, run in pairs.items():
        _replace_tree(work / "runs" / run / "pipeline", output / target)
    for kind in ("video", "image"):
        _replace_tree(work / "judges" / kind, output / "judges" / kind)
    for name in ("reproduction.csv", "reproduction.md", "side-by-side.png"):
        shutil.copy2(work / name, output / name)
    sizes = {p.name: _folder_mb(p) for p in sorted(output.iterdir()) if p.is_dir()}
    if figure is not None:
        figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(work / "side-by-side.png", figure)
    (output / "build_report.json").write_text(
        json.dumps(
            {
                "settings": dataclasses.asdict(s),
                "stages": report,
                "sizes_mb": sizes,
                "weights_sha256": weight_hashes(output),
            },
            indent=2,
        )
    )
    return {"output": str(output), "sizes_mb": sizes, "total_mb": round(sum(sizes.values()), 2)}


def _replace_tree(source: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.pt", "cache"))


def _folder_mb(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 2)


def build_demo_models(
    work_dir: str | Path,
    output: str | Path | None,
    settings: BuildSettings | None = None,
    overwrite: bool = False,
    on_step: Callable[[str, int], None] | None = None,
    figure: str | Path | None = None,
    from_build: str | Path | None = None,
) -> dict[str, Any]:
    """Run every stage (resuming a previous run in ``work_dir``, inside the stage it was killed in);
    returns the stage results.

    ``output`` (``None``: do not export) receives the four pipelines and two judges; an existing
    non-empty ``output`` is replaced only with ``overwrite`` (checked before any work starts).
    ``on_step(part, step)`` is called after every training step of every part (``video-vae``, ``t2v-softmax``, ...).
    ``figure``: where the export also copies the MHLA / softmax side-by-side figure (e.g. ``docs/...png``).
    ``from_build``: a folder a finished build exported to (its ``build_report.json`` and models); a new
    ``work_dir`` starts with that build's judges, VAEs and teachers (:func:`_start_from_build`), so only
    the data (seconds), the students and the evaluation run.
    """
    global _ON_STEP
    _ON_STEP = on_step
    try:
        return _build(
            work_dir,
            output,
            settings,
            overwrite,
            None if figure is None else Path(figure),
            None if from_build is None else Path(from_build),
        )
    finally:
        _ON_STEP = None


def _build(
    work_dir: str | Path,
    output: str | Path | None,
    settings: BuildSettings | None,
    overwrite: bool,
    figure: Path | None,
    from_build: Path | None = None,
) -> dict[str, Any]:
    s = settings or BuildSettings()
    work = Path(work_dir)
    out = Path(output) if output is not None else None
    if out is not None and out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} already holds models; pass --overwrite to replace them or choose another --output"
        )
    if from_build is not None:
        _start_from_build(work, from_build, s)
    work.mkdir(parents=True, exist_ok=True)
    settings_file = work / "settings.json"
    wanted = dataclasses.asdict(s)
    if settings_file.is_file():
        check_settings_change(work, json.loads(settings_file.read_text()), wanted)
    settings_file.write_text(json.dumps(wanted, indent=2))

    stages = Stages(work, total=7, watched=_WATCHED)
    report: dict[str, Any] = {}
    report["data"] = stages.run("data", lambda: _data(work, s))
    report["judges"] = stages.run("judges", lambda: _judges(work, s))
    report["autoencoders"] = stages.run("autoencoders", lambda: _autoencoders(work, s))
    report["base"] = stages.run("base", lambda: _base(work, s))
    report["teachers"] = stages.run("teachers", lambda: _teachers(work, s))
    report["students"] = stages.run("students", lambda: _students(work, s))
    report["evaluate"] = stages.run("evaluate", lambda: _evaluate(work, s))
    if out is not None:
        report["export"] = _export(work, out, s, report, figure)
    report["total_seconds"] = round(sum(v.get("seconds", 0) for v in report.values() if isinstance(v, dict)), 1)
    return report


# ---------------------------------------------------------------------------- starting from a finished build

#: The stages a build can take over from an exported build, and what each left in the work dir that later
#: stages read: (folder in the export, folder in the work dir). The data is made again (seeded, seconds);
#: the base pipelines only fed the teachers.
_REUSABLE: dict[str, list[tuple[str, str]]] = {
    "judges": [("judges/video", "judges/video"), ("judges/image", "judges/image")],
    "autoencoders": [
        ("shapes-t2v-softmax/vae", "autoencoders/video"),
        ("digits-c2i-softmax/vae", "autoencoders/image"),
    ],
    "base": [],
    "teachers": [
        ("shapes-t2v-softmax", "runs/t2v-softmax/pipeline"),
        ("digits-c2i-softmax", "runs/c2i-softmax/pipeline"),
    ],
}


def _start_from_build(work: Path, source: Path, s: BuildSettings) -> None:
    """Fill a new ``work`` with the judges, VAEs and teachers of the build exported to ``source``, and mark
    their stages finished with that build's results and seconds (``reused_from`` says where they came
    from). Everything is checked before anything is written: the settings those stages used must be
    ``s``'s, and the models must be the ones ``source/build_report.json`` lists (same SHA-256).
    A ``work`` this function already filled from ``source`` is left as it is (a killed build resumes); the
    copies are made in ``<work>.partial`` and renamed, so ``work`` is never half filled."""
    marker = work / "stages" / "teachers.json"
    if marker.is_file():
        reused_from = json.loads(marker.read_text()).get("reused_from")
        if reused_from is not None and Path(reused_from).resolve() == source.resolve():
            return
    if work.exists() and any(work.iterdir()):
        raise FileExistsError(
            f"--from-build starts a new work dir, but {work} already holds a build; choose an empty --work-dir"
        )
    report_file = source / "build_report.json"
    if not report_file.is_file():
        raise FileNotFoundError(
            f"--from-build {source}: no build_report.json there; give the folder a finished "
            "build exported to (e.g. mhla_diffusion/embedded/models)"
        )
    report = json.loads(report_file.read_text())
    before, wanted = report["settings"], dataclasses.asdict(s)
    changed = [k for k in changed_settings(before, wanted) if FIRST_STAGE.get(k, "data") in ("data", *_REUSABLE)]
    if changed:
        raise ValueError(
            f"--from-build {source}: that build's judges, VAEs or teachers were made with other settings "
            f"({describe_changes(changed, before, wanted)}); "
            "only student and evaluation settings may change; run a full build for the others"
        )
    for pairs in _REUSABLE.values():
        for exported, _ in pairs:
            expected = {k: v for k, v in report["weights_sha256"].items() if k.startswith(exported + "/")}
            found = {f"{exported}/{k}": v for k, v in weight_hashes(source / exported).items()}
            if not expected or found != expected:
                raise ValueError(
                    f"--from-build {source}: the weights in {source / exported} are not the ones its "
                    "build_report.json lists (changed after that build?); use the folder as exported"
                )
    partial = work.with_name(work.name + ".partial")  # renamed to ``work`` once complete
    if partial.exists():
        shutil.rmtree(partial)
    for stage, pairs in _REUSABLE.items():
        for exported, target in pairs:
            shutil.copytree(source / exported, partial / target)
        (partial / "stages").mkdir(parents=True, exist_ok=True)
        result = {**report["stages"][stage], "reused_from": str(source)}
        (partial / "stages" / f"{stage}.json").write_text(json.dumps(result, indent=2))
    (partial / "settings.json").write_text(json.dumps(report["settings"], indent=2))
    if work.exists():
        work.rmdir()  # empty (checked above)
    partial.rename(work)
    logger.info("work dir %s starts from the build in %s (judges, VAEs and teachers)", work, source)
