"""`mhla text-to-video`, `mhla class-to-image` and `mhla import-wan` end to end on tiny pipelines."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
from safetensors.torch import save_file

from helpers.cli import class_to_image, text_to_video
from helpers.original_format import released_model, to_original
from mhla_diffusion.cli import main


def test_text_to_video_writes_decodable_video_and_settings(pipeline_dirs, tmp_path, capsys):
    assert text_to_video(pipeline_dirs, tmp_path, "--prompt", "a red circle moving left", "--fps", "8") == 0
    video = tmp_path / "000-a-red-circle-moving-left-seed0-mhla.mp4"
    frames = np.stack(list(iio.imiter(video)))
    assert frames.shape == (9, 32, 48, 3)
    settings = json.loads(video.with_suffix(".json").read_text())
    assert settings["prompt"] == "a red circle moving left" and settings["attention"] == "mhla"
    assert settings["seed"] == 0 and settings["num_inference_steps"] == 2 and settings["wall_time_s"] > 0
    assert settings["block_layout"] == [2, 2, 2]
    assert "(mhla, " in capsys.readouterr().out


def test_formats_attention_modes_and_prompts_file(pipeline_dirs, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\na blue square\n")
    out = tmp_path / "out"
    assert text_to_video(pipeline_dirs, out, "--prompts-file", str(prompts), "--format", "gif") == 0
    assert (
        text_to_video(
            pipeline_dirs, out, "--prompts-file", str(prompts), "--format", "frames", "--attention", "softmax"
        )
        == 0
    )
    gif = np.stack(list(iio.imiter(out / "001-a-blue-square-seed0-mhla.gif")))
    assert gif.shape[:3] == (9, 32, 48)
    pngs = sorted((out / "001-a-blue-square-seed0-softmax").glob("frame_*.png"))
    assert len(pngs) == 9 and iio.imread(pngs[0]).shape == (32, 48, 3)
    softmax = np.stack([iio.imread(p) for p in pngs]).astype(int)
    assert np.abs(softmax - gif[..., :3].astype(int)).max() > 0  # softmax and MHLA give different videos
    settings = json.loads((out / "001-a-blue-square-seed0-softmax.json").read_text())
    assert settings["mhla_layers"] == [] and settings["attention"] == "softmax"


def test_one_frame_under_a_larger_layout_is_generated(pipeline_dirs, tmp_path):
    """--num-frames 1 gives token grid (1, 2, 3) under the 2x2x2 layout: the second frame block is empty."""
    assert text_to_video(pipeline_dirs, tmp_path, "--prompt", "a cat", "--num-frames", "1", "--format", "frames") == 0
    pngs = sorted((tmp_path / "000-a-cat-seed0-mhla").glob("frame_*.png"))
    assert len(pngs) == 1 and iio.imread(pngs[0]).shape == (32, 48, 3)


def test_existing_outputs_are_kept(pipeline_dirs, tmp_path, capsys):
    assert text_to_video(pipeline_dirs, tmp_path, "--prompt", "a cat") == 0
    video = tmp_path / "000-a-cat-seed0-mhla.mp4"
    before = video.read_bytes()
    assert text_to_video(pipeline_dirs, tmp_path, "--prompt", "a cat", "--seed", "0") == 2
    assert "--overwrite" in capsys.readouterr().err and video.read_bytes() == before
    assert text_to_video(pipeline_dirs, tmp_path, "--prompt", "a cat", "--overwrite") == 0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--prompt", "x", "--height", "40"], "height 40 must be a positive multiple of 16"),
        (["--prompt", " "], "empty prompt"),
        ([], "give a prompt"),
    ],
)
def test_text_to_video_bad_input(pipeline_dirs, tmp_path, capsys, extra, message):
    assert text_to_video(pipeline_dirs, tmp_path, *extra) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_step_count_is_checked_when_parsing(pipeline_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:  # argparse's own exit, before any model loads
        text_to_video(pipeline_dirs, tmp_path, "--prompt", "x", "--steps", "0")
    assert stopped.value.code == 2
    assert "argument --steps: expected an integer >= 1, got '0'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_more_bad_input(pipeline_dirs, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert text_to_video(pipeline_dirs, tmp_path / "o", "--prompts-file", str(empty)) == 2
    assert "has no prompts" in capsys.readouterr().err
    assert main(["text-to-video", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert text_to_video(pipeline_dirs, blocker / "sub", "--prompt", "x") == 2
    assert "is a file" in capsys.readouterr().err
    assert text_to_video(pipeline_dirs, tmp_path / "o", "--prompt", "x", weights=False) == 2
    assert "--attention mhla, but the model has no MHLA layers" in capsys.readouterr().err


def test_frame_count_is_rounded_with_a_warning(pipeline_dirs, tmp_path, capsys):
    assert text_to_video(pipeline_dirs, tmp_path, "--prompt", "x", "--format", "gif", "--num-frames", "11") == 0
    assert "generating 9 frames" in capsys.readouterr().err
    assert json.loads((tmp_path / "000-x-seed0-mhla.json").read_text())["num_frames"] == 9


def test_class_to_image(pipeline_dirs, tmp_path, capsys):
    assert class_to_image(pipeline_dirs, tmp_path, "--class", "goldfish,3", "--class", "hammerhead", steps=3) == 0
    image = iio.imread(tmp_path / "000-goldfish-seed0-mhla.png")
    assert image.shape == (16, 16, 3)
    settings = json.loads((tmp_path / "002-hammerhead-seed0-mhla.json").read_text())
    assert settings["class_id"] == 4 and settings["attention"] == "mhla"
    assert class_to_image(pipeline_dirs, tmp_path, "--class", "blue whale", steps=3) == 2
    assert "unknown class names ['blue whale']" in capsys.readouterr().err
    capsys.readouterr()
    assert class_to_image(pipeline_dirs, tmp_path, "--class", "goldfish", "--attention", "softmax", steps=3) == 0
    assert not np.array_equal(iio.imread(tmp_path / "000-goldfish-seed0-softmax.png"), image)


def test_import_wan_then_generate(pipeline_dirs, tmp_path, capsys):
    checkpoint = tmp_path / "released.safetensors"
    save_file(to_original(released_model(gate=True)), checkpoint)
    out = tmp_path / "transformer"
    assert (
        main(["import-wan", str(checkpoint), "--output", str(out), "--layout", "2x2x3", "--attention-head-dim", "12"])
        == 0
    )
    assert "MHLA on 2 of 3" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["mhla"]["layout"] == [2, 2, 3]
    # the imported transformer replaces the pipeline's (its text_dim and channels match the tiny pipeline)
    extra = ("--transformer", str(out), "--prompt", "x", "--format", "gif")
    assert text_to_video(pipeline_dirs, tmp_path / "videos", *extra, weights=False) == 0
    settings = json.loads((tmp_path / "videos" / "000-x-seed0-mhla.json").read_text())
    assert settings["transformer"] == str(out) and settings["mhla_layers"] == [1, 2]
    assert settings["block_layout"] == [2, 2, 3]


def test_unwritable_output_folder_is_refused(tmp_path, monkeypatch):
    from mhla_diffusion.pipelines import outputs

    monkeypatch.setattr(outputs.os, "access", lambda path, mode: False)  # root may write anywhere; simulate
    with pytest.raises(PermissionError, match="not writable"):
        outputs.plan_outputs(tmp_path / "new", ["a"], "mp4")
