"""`mhla build-embedded` in its smoke setting: every stage runs, the table and models come out, and
the command refuses to replace models or mix settings before doing any work."""

from __future__ import annotations

import csv
import json

import pytest

from mhla_diffusion.embedded.build import STUDENTS, BuildSettings, build_demo_models
from mhla_diffusion.embedded import embedded_judge, embedded_model


@pytest.fixture(scope="module")
def smoke_build(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-build")
    report = build_demo_models(root / "work", root / "out", BuildSettings.smoke())
    return root, report


def test_smoke_build_writes_models_judges_and_table(smoke_build):
    from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline

    root, report = smoke_build
    out = root / "out"
    rows = list(csv.DictReader((out / "reproduction.csv").open()))
    models = 3 + len(STUDENTS)  # the data, the data through the VAE, the teacher, the students
    assert [r["task"] for r in rows] == ["text-to-video"] * models + ["class-to-image"] * models
    for row in rows:
        assert 0 <= float(row["fid"]) and (row["seconds_per_sample"] == "" or float(row["seconds_per_sample"]) > 0)
    layouts = {r["model"]: r["layout"] for r in rows}
    assert layouts["linear attention (1 block)"] in ("1x1x1", "1x1")
    wan = MHLAWanPipeline.from_pretrained(embedded_model("text-to-video", "mhla", root=out))
    assert wan.mhla is not None and wan.mhla.layout == (1, 4, 4)
    assert MHLAWanPipeline.from_pretrained(embedded_model("text-to-video", "softmax", root=out)).mhla is None
    dit = MHLADiTPipeline.from_pretrained(embedded_model("class-to-image", "mhla", root=out))
    assert dit.mhla is not None and dit.labels["7"] == 7
    assert embedded_judge("video", root=out).is_dir() and embedded_judge("image", root=out).is_dir()
    saved = json.loads((out / "build_report.json").read_text())
    assert saved["settings"]["video_teacher_steps"] == BuildSettings.smoke().video_teacher_steps
    assert report["total_seconds"] > 0


def test_rerun_resumes_and_output_is_protected(smoke_build):
    root, _ = smoke_build
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_demo_models(root / "work", root / "out", BuildSettings.smoke())
    report = build_demo_models(root / "work", None, BuildSettings.smoke())  # every stage found finished
    assert "export" not in report and report["evaluate"]["rows"]
    other = BuildSettings.smoke()
    other.video_teacher_steps += 1
    with pytest.raises(ValueError, match="other settings"):
        build_demo_models(root / "work", None, other)


def test_settings_overrides_are_checked():
    from mhla_diffusion.embedded.build import settings_with

    changed = settings_with(BuildSettings(), ["video_teacher_steps=6000", "teacher_lr=1e-3", "train_digits=100"])
    assert (changed.video_teacher_steps, changed.teacher_lr, changed.train_digits) == (6000, 1e-3, 100)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        settings_with(BuildSettings(), ["video_teacher_step=1"])
    with pytest.raises(ValueError, match="must be of type int"):
        settings_with(BuildSettings(), ["video_teacher_steps=many"])
