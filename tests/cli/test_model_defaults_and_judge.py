"""`mhla text-to-video` / `class-to-image` take their defaults from the model they run, use the embedded softmax
teacher for `--attention softmax` on the embedded default, and write the judge's reading beside each sample."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest

from helpers.models import with_record
from mhla_diffusion.cli import main
from mhla_diffusion.embedded import embedded_defaults, embedded_model
from mhla_diffusion.utils.model_defaults import RECORD_KEY, published_wan_model, video_defaults
from mhla_diffusion.utils.wan_configs import WAN_TRANSFORMER_CONFIGS


def _settings(folder, pattern: str = "*.json") -> dict:
    (path,) = sorted(folder.glob(pattern))
    return json.loads(path.read_text())


def test_softmax_on_the_embedded_default_runs_the_softmax_teacher(tmp_path, capsys):
    assert (
        main(
            [
                "text-to-video",
                "--prompt",
                "a red circle moving left",
                "--attention",
                "softmax",
                "--steps",
                "2",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    teacher = str(embedded_model("text-to-video", "softmax"))
    assert f"embedded softmax teacher {teacher}" in captured.err
    settings = _settings(tmp_path)
    assert settings["model"] == teacher and settings["attention"] == "softmax" and settings["mhla_layers"] == []
    d = embedded_defaults()
    assert (settings["num_frames"], settings["height"], settings["width"]) == (d.num_frames, d.height, d.width)
    judge = settings["judge"]
    assert (
        judge["reading"]
        == f"{judge['colour']['value']} {judge['shape']['value']}, moving {judge['direction']['value']}"
    )
    assert judge["requested"] == {"shape": "circle", "colour": "red", "direction": "left"}
    assert isinstance(judge["matches_prompt"], bool) and 0 < judge["confidence"] <= 1
    assert f"judge: {judge['reading']} (confidence" in captured.out


@pytest.mark.slow  # generates and judges with an embedded model
def test_class_to_image_softmax_default_runs_the_digits_teacher_and_is_judged(tmp_path, capsys):
    assert main(["class-to-image", "--class", "7", "--attention", "softmax", "--output-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"embedded softmax teacher {embedded_model('class-to-image', 'softmax')}" in captured.err
    settings = _settings(tmp_path)
    assert settings["model"] == str(embedded_model("class-to-image", "softmax"))
    assert settings["num_inference_steps"] == embedded_defaults().image_steps  # the model's, not DiT-XL/2's 50
    judge = settings["judge"]
    assert judge["requested_class_id"] == 7 and judge["matches_class"] == (judge["class_id"] == 7)
    assert judge["reading"] == str(judge["class_id"]) and 0 < judge["confidence"] <= 1
    assert f"judge: {judge['reading']} (confidence" in captured.out


@pytest.mark.slow  # generates and judges with an embedded model
def test_an_embedded_folder_given_as_model_runs_at_its_trained_size(tmp_path, capsys):
    """`--model <embedded softmax folder>` once fell back to Wan2.1's 81x480x832."""
    teacher = embedded_model("text-to-video", "softmax")
    assert (
        main(
            [
                "text-to-video",
                "--model",
                str(teacher),
                "--attention",
                "softmax",
                "--prompt",
                "a blue square moving up",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "embedded softmax teacher" not in capsys.readouterr().err  # the user chose the folder
    settings = _settings(tmp_path)
    d = embedded_defaults()
    assert (settings["num_frames"], settings["height"], settings["width"]) == (d.num_frames, d.height, d.width)
    assert (settings["num_inference_steps"], settings["fps"]) == (d.video_steps, d.fps)
    assert settings["guidance_scale"] == d.video_guidance_scale
    assert np.stack(list(iio.imiter(settings["output"]))).shape == (d.num_frames, d.height, d.width, 3)


def test_a_clip_of_another_size_is_recorded_as_unread_by_the_judge(tmp_path, capsys):
    assert (
        main(
            [
                "text-to-video",
                "--prompt",
                "a red circle moving left",
                "--num-frames",
                "5",
                "--steps",
                "1",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    judge = _settings(tmp_path)["judge"]
    assert judge == {"reading": None, "why": "the judge reads 9-frame 48x48 clips, not 5x48x48"}
    assert "no judge reading: the judge reads 9-frame 48x48 clips" in capsys.readouterr().out


def test_a_model_that_records_no_size_needs_one_and_a_recorded_size_is_used(pipeline_dirs, tmp_path, capsys):
    weights = ["--mhla-weights", str(pipeline_dirs["wan_mhla"])]
    assert (
        main(
            [
                "text-to-video",
                "--model",
                str(pipeline_dirs["wan"]),
                *weights,
                "--prompt",
                "a cat",
                "--height",
                "32",
                "--output-dir",
                str(tmp_path / "none"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"{pipeline_dirs['wan']} has no default video size (no {RECORD_KEY} in its model_index.json" in err
    assert "give --num-frames, --width" in err and not (tmp_path / "none").exists()  # refused before any work

    record = dict(num_frames=5, height=32, width=48, num_inference_steps=2, fps=4, max_sequence_length=16)
    recorded = with_record(pipeline_dirs["wan"], tmp_path / "wan", record)
    assert (
        main(
            [
                "text-to-video",
                "--model",
                str(recorded),
                *weights,
                "--prompt",
                "a cat",
                "--output-dir",
                str(tmp_path / "recorded"),
            ]
        )
        == 0
    )
    settings = _settings(tmp_path / "recorded")
    assert (settings["num_frames"], settings["height"], settings["width"]) == (5, 32, 48)
    assert (settings["num_inference_steps"], settings["fps"], settings["guidance_scale"]) == (2, 4, 5.0)
    assert "judge" not in settings  # not an embedded model: no judge for its samples


@pytest.mark.parametrize(
    "record,message",
    [
        ({"height": "64"}, f"{RECORD_KEY}.height must be a whole number >= 1, got '64'"),
        ({"guidance_scale": float("nan")}, f"{RECORD_KEY}.guidance_scale must be a finite number >= 0"),
        ({"size": 64}, f"{RECORD_KEY} has unknown settings ['size']"),
    ],
)
def test_a_bad_record_is_a_readable_error(tmp_path, record, message):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", RECORD_KEY: record}))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        video_defaults(tmp_path)


def _transformer_folder(root, name: str, config: dict, two: bool = False):
    for component in ("transformer", "transformer_2") if two else ("transformer",):
        (root / name / component).mkdir(parents=True)
        (root / name / component / "config.json").write_text(json.dumps(config))
    return root / name


def test_published_wan_models_get_their_own_size_not_wan21_13b(tmp_path):
    assert (
        video_defaults("Wan-AI/Wan2.2-TI2V-5B-Diffusers").num_frames,
        video_defaults("Wan-AI/Wan2.2-TI2V-5B-Diffusers").height,
    ) == (121, 704)
    wan21 = video_defaults("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert (wan21.num_frames, wan21.height, wan21.width, wan21.steps) == (81, 480, 832, 50)
    # local folders under other names, told apart by their transformer configs
    ti2v = _transformer_folder(tmp_path, "mine", WAN_TRANSFORMER_CONFIGS["Wan2.2-TI2V-5B"])
    assert published_wan_model(ti2v) == "Wan2.2-TI2V-5B" and video_defaults(ti2v).fps == 24
    a14b = _transformer_folder(tmp_path, "experts", WAN_TRANSFORMER_CONFIGS["Wan2.2-T2V-A14B"], two=True)
    assert published_wan_model(a14b) == "Wan2.2-T2V-A14B" and video_defaults(a14b).height == 720
    # Wan2.1-I2V-14B 480P and 720P share one config: not guessed
    i2v = _transformer_folder(tmp_path, "i2v", WAN_TRANSFORMER_CONFIGS["Wan2.1-I2V-14B-480P"])
    assert published_wan_model(i2v) is None and video_defaults(i2v).missing_size == ["num_frames", "height", "width"]
    assert video_defaults("someone/my-wan").missing_size == ["num_frames", "height", "width"]
