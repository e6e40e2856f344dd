"""``mhla generate``: the other families' stock Diffusers pipelines with their transformer loaded through the MHLA
loader (tiny SkyReels-V2 and HunyuanVideo pipelines of the ``family_pipeline_dirs`` fixture)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from mhla_diffusion import load_mhla, load_transformer
from mhla_diffusion.cli import main

CLIP = ("--num-frames", "9", "--height", "32", "--width", "32", "--steps", "2", "--max-sequence-length", "16")


def _generate(dirs, family, out, *extra):
    return main(
        ["generate", "--model", str(dirs[family]), "--prompt", "a red square", "--output-dir", str(out), *CLIP, *extra]
    )


def _frames(path):
    import imageio.v3 as iio

    return np.asarray(iio.imread(path, plugin="pyav"))


@pytest.mark.parametrize("family", ["skyreels-v2", "hunyuan-video"])
def test_generates_with_the_stock_pipeline_and_the_mhla_weights(tmp_path, family_pipeline_dirs, family, capsys):
    from diffusers import DiffusionPipeline

    dirs, weights = family_pipeline_dirs, str(family_pipeline_dirs[f"{family}-mhla"])
    assert _generate(dirs, family, tmp_path / "mhla", "--mhla-weights", weights) == 0
    assert _generate(dirs, family, tmp_path / "softmax", "--mhla-weights", weights, "--attention", "softmax") == 0
    (video,) = (tmp_path / "mhla").glob("*.mp4")
    settings = json.loads(video.with_suffix(".json").read_text())
    assert settings["family"] == family and settings["mhla_from"] == "mhla_weights"
    assert settings["num_frames"] == 9 and settings["num_inference_steps"] == 2
    assert _frames(video).shape == (9, 32, 32, 3)

    # the same video as the stock pipeline with the MHLA transformer passed in (the documented Python recipe)
    transformer = load_mhla(weights, load_transformer(dirs[family]))
    pipe = DiffusionPipeline.from_pretrained(dirs[family], transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    call = dict(num_frames=9, height=32, width=32, num_inference_steps=2, max_sequence_length=16, output_type="np")
    expected = pipe("a red square", generator=torch.Generator().manual_seed(0), **call).frames[0]
    reference = tmp_path / "reference"
    from mhla_diffusion.pipelines.outputs import plan_outputs, save_video

    save_video(expected, plan_outputs(reference, ["v"], "mp4")[0], "mp4", 16)
    np.testing.assert_array_equal(_frames(video), _frames(reference / "v.mp4"))
    (softmax,) = (tmp_path / "softmax").glob("*.mp4")
    assert not np.array_equal(_frames(softmax), _frames(video))  # MHLA, not softmax


def test_flux_writes_the_images_of_the_stock_pipeline(tmp_path, family_pipeline_dirs):
    """Flux makes images: PNGs, the ones ``FluxPipeline`` makes with the MHLA transformer passed in (its own
    ``img_ids`` give the token grid); ``--num-frames`` is refused."""
    import imageio.v3 as iio
    from diffusers import FluxPipeline

    from mhla_diffusion.pipelines.outputs import float_to_uint8

    dirs, weights = family_pipeline_dirs, str(family_pipeline_dirs["flux-mhla"])
    image = ("--height", "32", "--width", "32", "--steps", "2", "--max-sequence-length", "16")
    command = ["generate", "--model", str(dirs["flux"]), "--prompt", "a red square", "--mhla-weights", weights]
    assert main([*command, "--output-dir", str(tmp_path), *image]) == 0
    (png,) = tmp_path.glob("*.png")
    assert json.loads(png.with_suffix(".json").read_text())["family"] == "flux"
    pipe = FluxPipeline.from_pretrained(dirs["flux"], transformer=load_mhla(weights, load_transformer(dirs["flux"])))
    pipe.set_progress_bar_config(disable=True)
    call = dict(height=32, width=32, num_inference_steps=2, max_sequence_length=16, output_type="np")
    expected = pipe("a red square", generator=torch.Generator().manual_seed(0), **call).images[0]
    np.testing.assert_array_equal(iio.imread(png), float_to_uint8(expected))
    assert main([*command, "--output-dir", str(tmp_path / "video"), *image, "--num-frames", "9"]) == 2


def test_mistakes_are_refused_before_any_model_loads(
    tmp_path, family_pipeline_dirs, pipeline_dirs, monkeypatch, capsys
):
    import diffusers

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", no_loading)
    dirs = family_pipeline_dirs
    weights = ["--mhla-weights", str(dirs["skyreels-v2-mhla"])]
    cases = [
        (
            "skyreels-v2",
            ["--mhla-weights", str(dirs["hunyuan-video-mhla"])],
            "are for a hunyuan-video transformer, but",
        ),
        ("skyreels-v2", [], "has no MHLA layers: pass --mhla-weights"),
        ("skyreels-v2", ["--mhla-weights", str(tmp_path / "missing")], "is not a folder"),
        ("wan", [], "is a Wan pipeline: generate with `mhla text-to-video"),
    ]
    (tmp_path / "taken").mkdir()
    kept = tmp_path / "taken" / "000-a-red-square-seed0-mhla.mp4"
    kept.write_bytes(b"keep")
    cases.append(("skyreels-v2", [*weights, "--output-dir", str(tmp_path / "taken")], "already exist.*--overwrite"))
    for family, extra, message in cases:
        capsys.readouterr()
        folders = {**dirs, "wan": pipeline_dirs["wan"]}
        assert _generate(folders, family, tmp_path / "out", *extra) == 2
        assert re.search(message, capsys.readouterr().err), message
    assert kept.read_bytes() == b"keep" and not (tmp_path / "out").exists()
