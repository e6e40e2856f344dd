"""`mhla build-embedded` in its smoke setting: every stage runs, the table and models come out, and
the command refuses to replace models or mix settings before doing any work."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml

from mhla_diffusion.embedded import embedded_judge, embedded_model
from mhla_diffusion.embedded.builds.build import build_demo_models
from mhla_diffusion.embedded.builds.build_settings import STUDENTS, BuildSettings
from mhla_diffusion.embedded.builds.side_by_side import FIGURE_PROMPTS
from mhla_diffusion.embedded.locations import embedded_defaults
from mhla_diffusion.embedded.worlds.moving_shapes import FRAME_SIZE


class _Killed(Exception):
    pass


@pytest.fixture(scope="module")
def smoke_build(tmp_path_factory):
    """The smoke build, killed twice on the way (inside the VAE stage, then inside the teachers' stage)
    and started again each time; ``steps`` records every training step each attempt ran."""
    root = tmp_path_factory.mktemp("demo-build")
    steps: list[list[tuple[str, int]]] = []

    def killer(part: str, at: int):
        def on_step(name: str, step: int) -> None:
            steps[-1].append((name, step))
            if (name, step) == (part, at):
                raise _Killed

        return on_step

    for part, at in [("video-vae", 1), ("t2v-softmax", 1)]:
        steps.append([])
        with pytest.raises(_Killed):
            build_demo_models(root / "work", root / "out", BuildSettings.smoke(), on_step=killer(part, at))
    steps.append([])
    report = build_demo_models(
        root / "work",
        root / "out",
        BuildSettings.smoke(),
        on_step=killer("", 0),
        figure=root / "docs" / "side-by-side.png",
    )
    return root, report, steps


@pytest.mark.slow
def test_killed_build_resumes_inside_the_running_stage(smoke_build):
    root, report, steps = smoke_build
    first, second, third = steps
    assert first[-1] == ("video-vae", 1) and ("video-judge", 1) in first
    # the second attempt skipped the finished judges and went on with the VAE at its second step
    assert [n for n, _ in second].count("video-judge") == 0 and second[0] == ("video-vae", 2)
    assert second[-1] == ("t2v-softmax", 1)
    assert third[0] == ("t2v-softmax", 2)  # the teacher continued from its step-1 checkpoint
    assert ("c2i-softmax", 1) in third and not any(n == "video-vae" for n, _ in third)
    assert len(report["autoencoders"]["attempt_seconds"]) == 2 and len(report["teachers"]["attempt_seconds"]) == 2
    assert report["autoencoders"]["seconds"] == pytest.approx(sum(report["autoencoders"]["attempt_seconds"]), abs=0.2)


@pytest.mark.slow
def test_smoke_build_writes_models_judges_and_table(smoke_build):
    from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline

    root, report, _ = smoke_build
    out = root / "out"
    rows = list(csv.DictReader((out / "reproduction.csv").open()))
    models = 3 + len(STUDENTS)  # the data, the data through the VAE, the teacher, the students
    assert [r["task"] for r in rows] == ["text-to-video"] * models + ["class-to-image"] * models
    for row in rows:
        assert 0 <= float(row["fid"]) and (row["seconds_per_sample"] == "" or float(row["seconds_per_sample"]) > 0)
    layouts = {r["model"]: r["layout"] for r in rows}
    assert layouts["MHLA (all layers)"] in ("x".join(map(str, BuildSettings.smoke().video_student_layout)), "4x4")
    wan = MHLAWanPipeline.from_pretrained(embedded_model("text-to-video", "mhla", root=out))
    assert wan.mhla is not None and wan.mhla.layout == tuple(BuildSettings.smoke().video_student_layout) == (1, 6, 6)
    teacher = MHLAWanPipeline.from_pretrained(embedded_model("text-to-video", "softmax", root=out))
    assert teacher.mhla is None
    # the video models sample with the noise-level shift they were trained with
    shift = BuildSettings.smoke().video_flow_shift
    assert teacher.scheduler.config.flow_shift == wan.scheduler.config.flow_shift == shift
    trained = yaml.safe_load((root / "work" / "runs" / "t2v-softmax" / "run_config.yaml").read_text())
    assert trained["flow_shift"] == shift
    dit = MHLADiTPipeline.from_pretrained(embedded_model("class-to-image", "mhla", root=out))
    assert dit.mhla is not None and dit.labels["7"] == 7
    assert embedded_judge("video", root=out).is_dir() and embedded_judge("image", root=out).is_dir()
    saved = json.loads((out / "build_report.json").read_text())
    assert saved["settings"]["video_teacher_steps"] == BuildSettings.smoke().video_teacher_steps
    from mhla_diffusion.embedded.locations import weight_hashes

    assert saved["weights_sha256"] == weight_hashes(out) and "shapes-t2v-mhla/transformer/" in " ".join(
        saved["weights_sha256"]
    )
    assert report["total_seconds"] > 0
    from PIL import Image

    figure = Image.open(root / "docs" / "side-by-side.png")
    assert figure.width > 2 * 5 * FRAME_SIZE * 2 and (out / "side-by-side.png").is_file()
    verdicts = saved["stages"]["evaluate"]["verdicts"]
    assert [v["prompt"] for v in verdicts] == list(FIGURE_PROMPTS)
    assert all(v["MHLA"]["reading"] and v["softmax"]["reading"] for v in verdicts)


@pytest.mark.slow
def test_exported_models_record_the_settings_the_build_samples_with(smoke_build):
    """The trainers' saved pipelines keep the steps, frame rate and guidance of the base pipelines they start
    from, which record the build's settings: the exported folders generate as the build evaluated them."""
    from mhla_diffusion.utils.model_defaults import RECORD_KEY

    root, _, _ = smoke_build
    s, d = BuildSettings.smoke(), embedded_defaults()
    for attention in ("softmax", "mhla"):
        video = json.loads(
            (embedded_model("text-to-video", attention, root=root / "out") / "model_index.json").read_text()
        )
        assert video[RECORD_KEY] == {
            "num_frames": d.num_frames,
            "height": d.height,
            "width": d.width,
            "num_inference_steps": s.video_sample_steps,
            "guidance_scale": s.video_guidance_scale,
            "fps": d.fps,
            "max_sequence_length": d.max_sequence_length,
        }
        image = json.loads(
            (embedded_model("class-to-image", attention, root=root / "out") / "model_index.json").read_text()
        )
        assert image[RECORD_KEY] == {
            "num_inference_steps": s.image_sample_steps,
            "guidance_scale": s.image_guidance_scale,
        }


@pytest.mark.slow
def test_rerun_resumes_and_output_is_protected(smoke_build):
    root, _, _ = smoke_build
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_demo_models(root / "work", root / "out", BuildSettings.smoke())
    report = build_demo_models(root / "work", None, BuildSettings.smoke())  # every stage found finished
    assert "export" not in report and report["evaluate"]["rows"]
    other = BuildSettings.smoke()
    other.video_teacher_steps += 1
    with pytest.raises(ValueError, match="video_teacher_steps 2 -> 3 would change stages that have already finished"):
        build_demo_models(root / "work", None, other)


# the last file an attempt wrote: a judge checkpoint, or a latent cached before a trainer's first step
@pytest.mark.parametrize("last_file", ["checkpoints/video-judge.pt", "cache/shapes/latents/0/latents.pt"])
def test_stage_killed_without_warning_counts_up_to_its_last_write(tmp_path, last_file):
    import os
    import time

    from mhla_diffusion.embedded.builds.build import _WATCHED
    from mhla_diffusion.training.stages import Stages

    work = tmp_path / "work"
    (work / "stages").mkdir(parents=True)
    started = time.time() - 100
    (work / "stages" / "judges.attempts.json").write_text(json.dumps([{"started": started, "seconds": None}]))
    written = work / last_file
    written.parent.mkdir(parents=True)
    written.write_text("x")
    for path in [written, *written.relative_to(work).parents][:-1]:  # the file and the folders it made
        os.utime(work / path, (started + 60, started + 60))  # a minute into the attempt
    result = Stages(work, total=1, watched=_WATCHED).run("judges", lambda: {})
    assert result["attempt_seconds"][0] == pytest.approx(60, abs=0.5) and len(result["attempt_seconds"]) == 2


def test_settings_of_unfinished_stages_may_change(tmp_path):
    from mhla_diffusion.embedded.builds.build_settings import check_settings_change

    work = tmp_path / "work"
    (work / "stages").mkdir(parents=True)
    (work / "stages" / "judges.json").write_text("{}")
    before = vars(BuildSettings.smoke()).copy()
    check_settings_change(work, before, {**before, "video_teacher_steps": 9, "checkpoint_every": 7})  # allowed
    with pytest.raises(ValueError, match="video_judge_steps"):
        check_settings_change(work, before, {**before, "video_judge_steps": 9})


def test_settings_overrides_are_checked():
    from mhla_diffusion.utils.options import settings_with

    changed = settings_with(BuildSettings(), ["video_teacher_steps=6000", "teacher_lr=1e-3", "train_digits=100"])
    assert (changed.video_teacher_steps, changed.teacher_lr, changed.train_digits) == (6000, 1e-3, 100)
    with pytest.raises(
        ValueError, match="unknown setting `video_teacher_step` \\(did you mean `video_teacher_steps`\\?\\)"
    ):
        settings_with(BuildSettings(), ["video_teacher_step=1"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        settings_with(BuildSettings(), ["video_teacher_steps"])
    with pytest.raises(ValueError, match="`video_teacher_steps` must be an integer, got .many."):
        settings_with(BuildSettings(), ["video_teacher_steps=many"])
    assert settings_with(BuildSettings(), ["video_student_lepe=False"]).video_student_lepe is False
    assert settings_with(BuildSettings(), ["video_student_gate=true"]).video_student_gate is True
    with pytest.raises(ValueError, match="`video_student_lepe` must be true or false, got .no."):
        settings_with(BuildSettings(), ["video_student_lepe=no"])


@pytest.mark.slow
def test_build_from_a_finished_build_trains_only_the_students(smoke_build, tmp_path, monkeypatch):
    """``--from-build``: a new work dir starts with the exported judges, VAEs and teachers; only the data,
    the students (here with another step count) and the evaluation run, and the report keeps the
    reused stages' results and seconds with where they came from."""
    import dataclasses

    from mhla_diffusion.embedded.locations import weight_hashes

    root, first, _ = smoke_build
    source = root / "out"
    settings = dataclasses.replace(BuildSettings.smoke(), video_student_steps=2)
    steps: list[str] = []
    report = build_demo_models(
        tmp_path / "work", tmp_path / "out", settings, from_build=source, on_step=lambda part, step: steps.append(part)
    )
    assert set(steps) == {"t2v-mhla", "c2i-mhla"} and steps.count("t2v-mhla") == settings.video_transfer_steps + 2
    for stage in ("judges", "autoencoders", "base", "teachers"):
        assert report[stage] == {**first[stage], "reused_from": str(source)}
    assert "reused_from" not in report["data"] and "reused_from" not in report["students"]
    saved, before = (json.loads((folder / "build_report.json").read_text()) for folder in (tmp_path / "out", source))
    assert saved["settings"] == dataclasses.asdict(settings) and saved["weights_sha256"] == weight_hashes(
        tmp_path / "out"
    )

    def kept(hashes):  # the teachers (with their VAEs) and the judges
        return {k: v for k, v in hashes.items() if "-softmax/" in k or k.startswith("judges/")}

    assert kept(saved["weights_sha256"]) == kept(before["weights_sha256"]) and kept(before["weights_sha256"])
    assert saved["weights_sha256"] != before["weights_sha256"]  # the students were trained again
    # the same command again finds every stage finished (a killed build resumes the same way), also with
    # the source folder spelt another way (relative here, absolute the first time)
    monkeypatch.chdir(root)
    again = build_demo_models(tmp_path / "work", None, settings, from_build=Path("out"))
    assert again["students"] == report["students"]


@pytest.mark.slow
def test_build_from_a_finished_build_checks_before_any_work(smoke_build, tmp_path):
    import dataclasses

    root, _, _ = smoke_build
    source = root / "out"
    work = tmp_path / "work"
    other = dataclasses.replace(BuildSettings.smoke(), video_teacher_steps=3)
    with pytest.raises(ValueError, match="video_teacher_steps 2 -> 3.*only student and evaluation settings may change"):
        build_demo_models(work, None, other, from_build=source)
    with pytest.raises(FileNotFoundError, match="no build_report.json"):
        build_demo_models(work, None, BuildSettings.smoke(), from_build=tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    weights = next((copy / "shapes-t2v-softmax" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")
    with pytest.raises(ValueError, match="not the ones its build_report.json lists"):
        build_demo_models(work, None, BuildSettings.smoke(), from_build=copy)
    assert not work.exists() and not (tmp_path / "work.partial").exists()
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="choose an empty --work-dir"):
        build_demo_models(work, None, BuildSettings.smoke(), from_build=source)
    assert (work / "notes.txt").read_text() == "mine"
