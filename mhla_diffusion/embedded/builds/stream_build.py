"""``mhla build-embedded --stream``: the embedded long-video models, trained on this CPU and judged at 8x their length.

Both streaming models start from the embedded text-to-video softmax teacher (``shapes-t2v-softmax`` of the build
in ``--from-build``, by default the package's own, which ``mhla build-embedded`` trains from scratch) and are
fine-tuned the same way on bouncing-shapes clips of ``train_frames`` frames (:mod:`.bouncing_shapes`): by
diffusion forcing (``finetune/train_wan``: one noise level per latent frame, block-causal attention):

* ``shapes-long-mhla``: block-causal MHLA (``MHLAConfig(causal=True)``, each latent frame one temporal block row),
  streamed with its constant-size state (:class:`~mhla_diffusion.models.streaming.CausalStream`);
* ``shapes-long-softmax``: block-causal softmax, streamed with a KV cache (the reference).

Stages (each writes into ``--work-dir`` and is skipped when a rerun finds it finished; trainers resume from their
last checkpoint):

1. ``data``: the bouncing-shapes training clips (a GIF folder for the Wan trainer);
2. ``judge``: the long-video judge (the video judge's network on 9-frame windows of bouncing videos);
3. ``mhla`` and 4. ``softmax``: the two fine-tunes;
5. ``evaluate``: the long-video report (:mod:`.long_video_report`): the two streams and the non-streaming
   embedded MHLA model run as independent clips, on the same prompts and seeds, at ``eval_frames`` frames;
6. ``export``: the models, the judge and ``long_video_report.json`` / ``.md`` to ``--output``, the strip figure
   to ``--figure``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...training.loop import LoopProgress
from ...training.stages import Stages
from ..judges.judge_io import save_judge
from ..judges.video_judge import prompt_accuracy, train_video_judge
from ..locations import EMBEDDED_ROOT, embedded_defaults, weight_hashes
from ..worlds.bouncing_shapes import BOUNCE_FRAMES, bouncing_windows
from ..worlds.shapes_dataset import write_shapes_dataset
from .build import _replace_tree, _Run, _run_values, _train_run
from .build_settings import check_settings_change

__all__ = ["STREAM_MODELS", "StreamBuildSettings", "build_stream_models", "causal_student_start"]

logger = logging.getLogger(__name__)

#: Exported folder -> run name in the work dir.
STREAM_MODELS = {"shapes-long-mhla": "long-mhla", "shapes-long-softmax": "long-softmax"}
DATA_SEED, HELD_OUT_SEED = 20_000, 21_000
_WATCHED = ("checkpoints", "runs", "cache", "evaluate", "judges", "data", "start")


@dataclass
class StreamBuildSettings:
    """Sizes and budgets of one streaming build (defaults: the committed models; :meth:`smoke`: CI)."""

    train_clips: int = 960
    train_frames: int = BOUNCE_FRAMES  # 17 frames = 9 latent frames
    judge_steps: int = 1500
    judge_held_out: int = 480
    steps: int = 800  # each fine-tune
    lr: float = 3e-4
    # Attention-transfer steps before the MHLA fine-tune (each causal MHLA layer first learns to reproduce the
    # softmax layer it replaces, as the main build's students do); the softmax teacher has none.
    transfer_steps: int = 0
    batch_size: int = 8
    # How the causal fine-tunes train (the trainer's causal_objective): "diffusion_forcing" (a shifted level per chunk;
    # clean_chunks below), or "teacher_forcing" (a clean copy and a noisy copy of the clip in one pass: each noisy
    # chunk sees the clean chunks before it, as a stream does).
    objective: str = "diffusion_forcing"
    # Diffusion forcing: one latent frame per chunk; each frame but a clip's last is clean context with this
    # probability (a stream's context is always clean, so half the training sees what inference sees).
    chunk_frames: int = 1
    clean_chunks: float = 0.5
    # The first chunk's latent frames (None: chunk_frames), e.g. 1 with chunks of 4: 9 = 1 + 2 x 4, 65 = 1 + 16 x 4.
    first_chunk_frames: int | None = None
    # Context noise (the trainer's causal_context_noise, recorded for the stream): context chunks train at a level
    # drawn from [0, context_noise), and the stream re-noises each finished chunk to it.
    context_noise: float = 0.0
    # Block-causal MHLA: the video student's 6x6 blocks per latent frame, two earlier frames mixed one by one,
    # older ones summed; the output gate as the non-streaming student (LePE reads the next frame, so none).
    layout: list[int] = dataclasses.field(default_factory=lambda: [1, 6, 6])
    # Where the MHLA fine-tune starts: "softmax" converts the softmax teacher (every MHLA weight new), "student"
    # the embedded non-streaming MHLA student (shapes-t2v-mhla) made causal with its weights
    # (:func:`causal_student_start`).
    mhla_start: str = "softmax"
    causal_window: int = 2
    # How rows older than the window reach a query: "sum" (every older row at full weight, so the fold grows with
    # the video: a 65-frame stream folds 62 rows where the 9-frame clips folded at most 6), "decay" (learned) or
    # "mean" (averaged: the same scale at any length).
    causal_fold: str = "sum"
    gate: bool = True
    eval_prompts: int = 12
    eval_frames: int = 129  # 8x the 17-frame training clips, 65 latent frames
    eval_steps: int = embedded_defaults().video_steps
    guidance_scale: float = embedded_defaults().video_guidance_scale
    checkpoint_every: int = 100
    seed: int = 0

    @classmethod
    def smoke(cls) -> "StreamBuildSettings":
        return cls(
            train_clips=8,
            judge_steps=2,
            judge_held_out=8,
            steps=2,
            batch_size=2,
            eval_prompts=1,
            eval_frames=25,
            eval_steps=2,
            checkpoint_every=1,
        )


def _first_stage(setting: str) -> str:
    """The first stage that reads ``setting`` (a rerun may change the settings of stages not finished yet)."""
    if setting in ("judge_steps", "judge_held_out"):
        return "judge"
    if setting.startswith("eval") or setting == "guidance_scale":
        return "evaluate"
    if setting in ("train_clips", "train_frames", "seed"):
        return "data"
    return "mhla"  # the fine-tunes' settings, and the model they start from


def _data(work: Path, s: StreamBuildSettings) -> dict[str, Any]:
    write_shapes_dataset(
        work / "data" / "bouncing", s.train_clips, seed=DATA_SEED, overwrite=True, bouncing_frames=s.train_frames
    )
    return {"train_clips": s.train_clips, "train_frames": s.train_frames}


def _judge(work: Path, s: StreamBuildSettings) -> dict[str, Any]:
    progress = LoopProgress(checkpoint=work / "checkpoints" / "long-video-judge.pt", every=s.checkpoint_every)
    judge = train_video_judge(steps=s.judge_steps, seed=s.seed, data="bouncing", progress=progress)
    windows, labels, _ = bouncing_windows(s.judge_held_out, seed=HELD_OUT_SEED)
    accuracy = prompt_accuracy(judge, windows, labels)
    save_judge(judge, work / "judges" / "long-video", metadata={"held_out_accuracy": accuracy}, overwrite=True)
    return {"held_out_accuracy": accuracy, "held_out_windows": s.judge_held_out}


def _options(work: Path, s: StreamBuildSettings, name: str, start: Path, mhla: dict[str, Any] | None):
    """The Wan trainer's options of the fine-tune ``runs/long-{name}``: the main build's (:func:`.build._run_values`)
    with the bouncing clips and the causal objective (diffusion or teacher forcing); softmax runs block-causal (the
    KV-cache teacher)."""
    from ...finetune.options import WanTrainOptions, options_from_dict

    d = embedded_defaults()
    transfer = s.transfer_steps if mhla is not None else 0
    values = _run_values(work, s, "long", "bouncing", _Run(name, start, s.steps, s.lr, mhla, transfer))
    values.update(
        height=d.height,
        width=d.width,
        num_frames=s.train_frames,
        max_sequence_length=d.max_sequence_length,
        caption_dropout=0.1,
        train_batch_size=s.batch_size,
        causal_objective=s.objective,
        causal_chunk_frames=s.chunk_frames,
        causal_first_chunk_frames=s.first_chunk_frames,
        causal_context_noise=s.context_noise,
        flow_shift=_flow_shift(start),  # the teacher's training noise levels and sampler
    )
    if s.objective != "teacher_forcing":  # teacher forcing's context is always the clean copy
        values["causal_clean_chunks"] = s.clean_chunks
    if mhla is None:
        values["softmax_block_causal"] = True
    return options_from_dict(WanTrainOptions, values)


def _flow_shift(start: Path) -> float:
    return float(json.loads((start / "scheduler" / "scheduler_config.json").read_text())["flow_shift"])


def causal_student_start(source: Path, output: Path, s: StreamBuildSettings) -> Path:
    """The causal MHLA start of the streaming fine-tune made from the build ``source``'s non-streaming MHLA student
    (``shapes-t2v-mhla``), saved as a pipeline at ``output`` (kept when already there); returns ``output``.

    The softmax teacher's pipeline (``shapes-t2v-softmax``: its scheduler and the student's VAE and text encoder,
    which are the teacher's) is converted with ``MHLAConfig(causal=True)`` and ``s``'s layout, window, fold and gate,
    then takes every weight the student has: the projections, norms, FFN and gate, and its spatial mixing ``(S, S)``
    for every temporal offset and the fold (``(K + 2, S, S)``), so a query first mixes the past as the student mixed
    the whole clip. The student's LePE (a convolution that reads the next frame) is dropped; a decay fold starts at
    its initial value. The student's layout must be ``s.layout``.
    """
    import torch
    from safetensors.torch import load_file

    from ...config import MHLAConfig
    from ...pipelines import MHLAWanPipeline

    if (output / "model_index.json").is_file():
        return output
    student_dir = source / "shapes-t2v-mhla" / "transformer"
    student_layout = json.loads((student_dir / "mhla_config.json").read_text())["mhla_config"]["layout"]
    if list(student_layout) != list(s.layout):
        raise ValueError(
            f"mhla_start student: the student's layout {student_layout} is not the stream's {s.layout}; set layout "
            f"to {student_layout}, or mhla_start to softmax"
        )
    pipe = MHLAWanPipeline.from_pretrained(source / "shapes-t2v-softmax")
    config = MHLAConfig(
        layout=tuple(s.layout), causal=True, causal_window=s.causal_window, causal_fold=s.causal_fold, gate=s.gate
    )
    pipe.convert_to_mhla(config)
    own = pipe.transformer.state_dict()
    student = load_file(student_dir / "diffusion_pytorch_model.safetensors")
    with torch.no_grad():
        for key, value in student.items():
            if ".processor.lepe" in key or (".processor.gate" in key and not s.gate):
                continue
            own[key].copy_(value.expand_as(own[key]) if key.endswith(".processor.mixing") else value)
    partial = output.with_name(output.name + ".partial")  # a killed save leaves no folder that looks finished
    shutil.rmtree(partial, ignore_errors=True)
    pipe.save_pretrained(partial)
    partial.rename(output)
    return output


def _fine_tune(work: Path, s: StreamBuildSettings, name: str, start: Path) -> dict[str, Any]:
    from ...finetune.train_wan import train as train_wan

    mhla = None
    if name == "mhla" and s.mhla_start == "student":
        start = causal_student_start(start.parent, work / "start" / "long-mhla", s)
    if name == "mhla":
        mhla = {
            "layout": list(s.layout),
            "causal": True,
            "causal_window": s.causal_window,
            "causal_fold": s.causal_fold,
            "gate": s.gate,
        }
    options = _options(work, s, name, start, mhla)
    seconds = _train_run(work, train_wan, options)
    return {"steps": s.steps, "seconds_of_run": seconds, "start": str(start)}


def _evaluate(work: Path, s: StreamBuildSettings, source: Path) -> dict[str, Any]:
    from .long_video_report import evaluate_long_video

    return evaluate_long_video(work, s, source)


def _export(work: Path, output: Path, s: StreamBuildSettings, report: dict[str, Any], figure: Path | None) -> dict:
    output.mkdir(parents=True, exist_ok=True)
    for target, run in STREAM_MODELS.items():
        _replace_tree(work / "runs" / run / "pipeline", output / target)
    _replace_tree(work / "judges" / "long-video", output / "judges" / "long-video")
    for name in ("long_video_report.json", "long_video_report.md", "long-video-strip.png"):
        shutil.copy2(work / "evaluate" / name, output / name)
    if figure is not None:
        figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(work / "evaluate" / "long-video-strip.png", figure)
    exported = [*STREAM_MODELS, "judges/long-video"]
    hashes = {f"{folder}/{k}": v for folder in exported for k, v in weight_hashes(output / folder).items()}
    total = round(sum(v.get("seconds", 0) for v in report.values() if isinstance(v, dict)), 1)
    content = {"settings": dataclasses.asdict(s), "stages": report, "total_seconds": total, "weights_sha256": hashes}
    (output / "stream_build_report.json").write_text(json.dumps(content, indent=2) + "\n")
    return {"output": str(output), "models": exported}


def build_stream_models(
    work_dir: str | Path,
    output: str | Path | None,
    settings: StreamBuildSettings | None = None,
    from_build: str | Path | None = None,
    figure: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Run every stage (module docstring), resuming a killed build in ``work_dir``; returns the stage results.

    ``from_build``: the exported build whose ``shapes-t2v-softmax`` both models start from (default: the
    package's). ``output`` (``None``: no export) receives the two pipelines, the judge and the report; models
    already there are replaced only with ``overwrite`` (checked before any work).
    """
    s = settings or StreamBuildSettings()
    if s.mhla_start not in ("softmax", "student"):
        raise ValueError(f"mhla_start must be softmax or student, got {s.mhla_start!r}")
    work = Path(work_dir)
    source = Path(from_build) if from_build is not None else EMBEDDED_ROOT
    start = source / "shapes-t2v-softmax"
    if not (start / "model_index.json").is_file():
        raise FileNotFoundError(
            f"the streaming build starts from {start}, which holds no pipeline: give --from-build the folder "
            "`mhla build-embedded` exported to"
        )
    out = Path(output) if output is not None else None
    if out is not None and not overwrite:
        taken = [str(out / name) for name in STREAM_MODELS if (out / name).exists()]
        if taken:
            raise FileExistsError(f"{', '.join(taken)} already exist; pass --overwrite to replace them")
    work.mkdir(parents=True, exist_ok=True)
    settings_file = work / "settings.json"
    wanted = {**dataclasses.asdict(s), "from_build": str(source.resolve())}
    if settings_file.is_file():
        check_settings_change(work, json.loads(settings_file.read_text()), wanted, _first_stage)
    settings_file.write_text(json.dumps(wanted, indent=2))

    stages = Stages(work, total=5, watched=_WATCHED)
    report: dict[str, Any] = {}
    report["data"] = stages.run("data", lambda: _data(work, s))
    report["judge"] = stages.run("judge", lambda: _judge(work, s))
    report["mhla"] = stages.run("mhla", lambda: _fine_tune(work, s, "mhla", start))
    report["softmax"] = stages.run("softmax", lambda: _fine_tune(work, s, "softmax", start))
    report["evaluate"] = stages.run("evaluate", lambda: _evaluate(work, s, source))
    if out is not None:
        report["export"] = _export(work, out, s, report, Path(figure) if figure is not None else None)
    report["total_seconds"] = round(sum(v.get("seconds", 0) for v in report.values() if isinstance(v, dict)), 1)
    return report
