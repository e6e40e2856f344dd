"""`mhla image-to-video`, and `mhla convert` / `mhla text-to-video` on Wan2.2 pipeline folders (tiny models)."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest

from helpers.wan_family import LAYOUT, first_frame, text_tokens
from mhla_diffusion.cli import main
from mhla_diffusion.ops.block_layout import auto_layout
from mhla_diffusion.pipelines import MHLAWanPipeline

VIDEO = ["--num-frames", "9", "--height", "32", "--width", "32", "--steps", "2", "--max-sequence-length", "16"]


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "first.png"
    first_frame(32).save(path)
    return path


def i2v(dirs, variant, image, out, *extra):
    return main(
        [
            "image-to-video",
            "--model",
            str(dirs[variant]),
            "--mhla-weights",
            str(dirs[f"{variant}-mhla"]),
            "--image",
            str(image),
            "--output-dir",
            str(out),
            *VIDEO,
            "--max-sequence-length",
            str(text_tokens(variant)),
            *extra,
        ]
    )


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-a14b-i2v"])
def test_image_to_video_writes_video_and_settings(wan_family_dirs, image, tmp_path, capsys, variant):
    assert i2v(wan_family_dirs, variant, image, tmp_path, "--prompt", "a red circle") == 0
    video = tmp_path / "000-a-red-circle-seed0-mhla.mp4"
    frames = np.stack(list(iio.imiter(video)))
    assert frames.shape == (9, 32, 32, 3)
    settings = json.loads(video.with_suffix(".json").read_text())
    assert settings["task"] == "image-to-video" and settings["image"] == str(image)
    assert settings["prompt"] == "a red circle" and settings["attention"] == "mhla" and settings["num_frames"] == 9
    assert settings["block_layout"] == list(LAYOUT) and settings["mhla_layers"] == [0, 1]
    if variant == "wan2.2-a14b-i2v":
        assert settings["block_layout_2"] == list(LAYOUT) and settings["boundary_ratio"] == 0.9
    else:
        assert "block_layout_2" not in settings and settings["boundary_ratio"] is None
    assert "(mhla, " in capsys.readouterr().out
    assert (
        i2v(
            wan_family_dirs,
            variant,
            image,
            tmp_path,
            "--prompt",
            "a red circle",
            "--attention",
            "softmax",
            "--format",
            "frames",
        )
        == 0
    )
    softmax = np.stack([iio.imread(p) for p in sorted((tmp_path / "000-a-red-circle-seed0-softmax").glob("*.png"))])
    assert softmax.shape == (9, 32, 32, 3) and np.abs(softmax.astype(int) - frames.astype(int)).max() > 0


def test_image_to_video_bad_input_fails_before_loading(wan_family_dirs, image, tmp_path, capsys):
    out = tmp_path / "out"
    assert i2v(wan_family_dirs, "wan2.1-i2v", tmp_path / "missing.png", out, "--prompt", "x") == 2
    assert "--image" in capsys.readouterr().err and not out.exists()
    text = tmp_path / "not-an-image.png"
    text.write_text("hello")
    assert i2v(wan_family_dirs, "wan2.1-i2v", text, out, "--prompt", "x") == 2
    assert "is not an image" in capsys.readouterr().err
    assert i2v(wan_family_dirs, "wan2.1-i2v", image, out, "--prompt", "x", "--height", "40") == 2
    assert "height 40 must be a positive multiple of 16" in capsys.readouterr().err
    assert i2v(wan_family_dirs, "wan2.1-i2v", image, out, "--prompt", "x", "--max-sequence-length", "16") == 2
    assert "--max-sequence-length is 16 text tokens, but this image-to-video model" in capsys.readouterr().err
    a14b = wan_family_dirs["wan2.2-a14b-i2v-mhla"]
    assert (
        main(
            [
                "image-to-video",
                "--model",
                str(wan_family_dirs["wan2.2-a14b-i2v"]),
                "--mhla-weights",
                str(a14b / "transformer"),
                "--image",
                str(image),
                "--prompt",
                "x",
                "--output-dir",
                str(out),
                *VIDEO,
            ]
        )
        == 2
    )
    assert "--mhla-weights-2" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):  # argparse: --image and --model are required
        main(["image-to-video", "--model", str(wan_family_dirs["wan2.1-i2v"]), "--prompt", "x"])
    assert "--image" in capsys.readouterr().err


def test_convert_a14b_pipeline_converts_both_transformers(wan_family_dirs, tmp_path, capsys):
    model, out = wan_family_dirs["wan2.2-a14b-t2v"], tmp_path / "mhla"
    assert main(["convert", "--model", str(model), "--layout", "2x2x2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("MHLA on 2 of 2 self-attention layers") == 2
    assert "model: transformer_2 of" in printed and f"saved MHLA weights to {out / 'transformer_2'}:" in printed
    for name in ("transformer", "transformer_2"):
        meta = json.loads((out / name / "mhla_config.json").read_text())
        assert meta["mhla_config"]["layout"] == list(LAYOUT) and (out / name / "mhla_weights.safetensors").is_file()
    pipe = MHLAWanPipeline.from_pretrained(model, mhla_weights=out)
    assert {name: c.layout for name, c in pipe.mhla_conversions.items()} == {
        "transformer": LAYOUT,
        "transformer_2": LAYOUT,
    }
    assert main(["convert", "--model", str(model), "--layout", "2x2x2", "--output", str(out), "--no-check"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    videos = tmp_path / "videos"
    assert (
        main(
            [
                "text-to-video",
                "--model",
                str(model),
                "--mhla-weights",
                str(out),
                "--prompt",
                "x",
                "--output-dir",
                str(videos),
                "--format",
                "gif",
                *VIDEO,
            ]
        )
        == 0
    )
    settings = json.loads((videos / "000-x-seed0-mhla.json").read_text())
    assert settings["mhla_layers"] == settings["mhla_layers_2"] == [0, 1]
    assert settings["block_layout_2"] == list(LAYOUT) and settings["boundary_ratio"] == 0.875


def test_convert_ti2v_layout_follows_the_wan22_vae(wan_family_dirs, tmp_path):
    """--target-size becomes tokens with the pipeline's own VAE: x16 in space for Wan2.2-TI2V-5B."""
    out = tmp_path / "mhla"
    assert (
        main(
            [
                "convert",
                "--model",
                str(wan_family_dirs["wan2.2-ti2v"]),
                "--target-size",
                "121x704x1280",
                "--output",
                str(out),
                "--no-check",
            ]
        )
        == 0
    )
    config = json.loads((out / "mhla_config.json").read_text())["mhla_config"]
    assert config["target_grid"] == [31, 22, 40]  # with Wan2.1's x8 VAE it would be (31, 44, 80)
    assert config["layout"] == list(auto_layout((31, 22, 40)))
