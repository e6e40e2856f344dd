"""The web demo's parts that need no server: input checks, flags, model sources, output folders."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from helpers.models import with_record
from mhla_diffusion.web import DemoInputError, Limits, image_request, video_request
from mhla_diffusion.web.app import build_parser
from mhla_diffusion.web.config import config_from_args, resolve_task_models
from mhla_diffusion.web.outputs import SessionOutputs

GOOD_VIDEO = dict(
    prompt=" a cat ", negative_prompt=None, seed=3.0, steps=20, guidance=5, num_frames=17, height=64, width=96
)


def test_video_request_accepts_and_normalises():
    request = video_request(**GOOD_VIDEO)
    assert (request.prompt, request.negative_prompt, request.seed, request.num_frames) == ("a cat", "", 3, 17)
    assert (request.height, request.width, request.steps, request.guidance_scale) == (64, 96, 20, 5.0)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(prompt="   "), "prompt is empty"),
        (dict(prompt=None), "prompt is empty"),
        (dict(height=50), "Height 50 is not supported: use a multiple of 16"),
        (dict(width=2048), "Width 2048 is out of range"),
        (dict(width=0), "Width 0 is out of range"),
        (dict(steps=0), "Steps 0 is out of range"),
        (dict(steps=101), "Steps 101 is out of range"),
        (dict(steps=2.5), "Steps must be a whole number"),
        (dict(steps=None), "Steps is missing"),
        (dict(num_frames=16), "use 4k+1 frames"),
        (dict(num_frames=85), "Frames 85 is too many"),
        (dict(seed=-1), "Seed -1 is out of range"),
        (dict(guidance=float("nan")), "Guidance scale must be a finite number"),
        (dict(guidance=50), "Guidance scale 50 is out of range"),
    ],
)
def test_video_request_errors_are_readable(change, message):
    with pytest.raises(DemoInputError, match=message.replace("+", r"\+")):
        video_request(**{**GOOD_VIDEO, **change})


def test_limits_are_configurable():
    with pytest.raises(DemoInputError, match="at most 9"):
        video_request(**{**GOOD_VIDEO, "num_frames": 13}, limits=Limits(max_frames=9))


def test_video_request_follows_the_models_geometry(pipeline_dirs):
    from mhla_diffusion.utils.geometry import VideoGeometry

    # a VAE that is 4x in space: 8 px would make whole patches, but Diffusers' WanPipeline takes multiples of 16
    x4 = VideoGeometry(vae_scale_spatial=4, max_tokens_per_axis=64)
    assert video_request(**GOOD_VIDEO, geometry=x4).height == 64
    with pytest.raises(
        DemoInputError, match=r"Height 72 .*multiple of 16 \(VAE x4 in space, patch 2: 8; Diffusers' WanPipeline"
    ):
        video_request(**{**GOOD_VIDEO, "height": 72}, geometry=x4)
    with pytest.raises(
        DemoInputError, match=r"Width 528 is larger than the model supports: at most 512 .*64 tokens per axis"
    ):
        video_request(**{**GOOD_VIDEO, "width": 528}, geometry=x4)
    # a VAE that compresses time 2x: 2k+1 frames, named with the model's factors
    assert (
        video_request(**{**GOOD_VIDEO, "num_frames": 7}, geometry=VideoGeometry(vae_scale_temporal=2)).num_frames == 7
    )
    with pytest.raises(DemoInputError, match=r"Frames 6 .*use 2k\+1 frames \(1, 3, 5, 7, 9, ...; VAE x2 in time"):
        video_request(**{**GOOD_VIDEO, "num_frames": 6}, geometry=VideoGeometry(vae_scale_temporal=2))
    # read from a pipeline folder: the tiny Wan's RoPE holds 32 positions per axis (512 px)
    tiny = VideoGeometry.from_folder(pipeline_dirs["wan"])
    with pytest.raises(DemoInputError, match="Width 528 is larger than the model supports: at most 512"):
        video_request(**{**GOOD_VIDEO, "width": 528}, geometry=tiny)


LABELS = {"tench": 0, "Tinca tinca": 0, "goldfish": 1}


def test_image_request_by_name_or_id():
    assert image_request("goldfish", 0, 10, 4.0, LABELS, 1000).class_id == 1
    assert image_request(" 7 ", 0, 10, 4.0, LABELS, 1000).class_id == 7
    assert image_request("Tinca tinca", 0, 10, 4.0, LABELS, 1000).class_label == "Tinca tinca"
    for bad, message in (
        ("zebra", "Unknown class 'zebra'.*names such as tench"),
        ("1000", "id from 0 to 999"),
        ("", "No class given"),
        ("-1", "Unknown class"),
    ):
        with pytest.raises(DemoInputError, match=message):
            image_request(bad, 0, 10, 4.0, LABELS, 1000)


def test_flags_and_environment(pipeline_dirs, monkeypatch):
    monkeypatch.setenv("MHLA_DEMO_C2I_MODEL", str(pipeline_dirs["dit"]))
    monkeypatch.setenv("MHLA_DEMO_CONCURRENCY", "2")
    monkeypatch.setenv("MHLA_DEMO_HEIGHT", "32")
    args = build_parser().parse_args(
        [
            "--t2v-model",
            str(pipeline_dirs["wan"]),
            "--t2v-mhla-weights",
            str(pipeline_dirs["wan_mhla"]),
            "--num-frames",
            "9",
            "--width",
            "48",
            "--max-steps",
            "30",
        ]
    )
    config = config_from_args(args)
    assert config.video.softmax_source == "base" and config.video.mhla_weights == pipeline_dirs["wan_mhla"]
    assert config.image.model == str(pipeline_dirs["dit"]) and config.image.softmax_source == "same"
    assert (config.concurrency, config.host, config.defaults.num_frames, config.limits.max_steps) == (
        2,
        "127.0.0.1",
        9,
        30,
    )
    assert (config.defaults.height, config.defaults.width) == (32, 48)


def test_form_defaults_are_the_models_own(pipeline_dirs, tmp_path):

    from mhla_diffusion.embedded import embedded_defaults

    d = embedded_defaults()
    config = config_from_args(build_parser().parse_args([]))  # the embedded models
    assert (config.defaults.num_frames, config.defaults.height, config.defaults.width) == (
        d.num_frames,
        d.height,
        d.width,
    )
    assert (config.defaults.video_steps, config.defaults.image_steps, config.defaults.fps) == (
        d.video_steps,
        d.image_steps,
        d.fps,
    )
    assert config.max_sequence_length == d.max_sequence_length
    # a model that records no size: the demo asks for one (it used to start at the embedded model's 64x64)
    tiny = ["--t2v-model", str(pipeline_dirs["wan"]), "--t2v-mhla-weights", str(pipeline_dirs["wan_mhla"])]
    with pytest.raises(ValueError, match=r"has no default video size .* give --num-frames, --height, --width"):
        config_from_args(build_parser().parse_args(tiny))
    record = dict(num_frames=5, height=32, width=48, num_inference_steps=3, max_sequence_length=16)
    recorded = with_record(pipeline_dirs["wan"], tmp_path / "wan", record)
    config = config_from_args(build_parser().parse_args(["--t2v-model", str(recorded), *tiny[2:]]))
    assert (config.defaults.num_frames, config.defaults.height, config.defaults.width) == (5, 32, 48)
    assert (config.defaults.video_steps, config.max_sequence_length, config.defaults.fps) == (3, 16, 16)
    assert config.defaults.image_steps == d.image_steps  # the class-to-image model is still the embedded one


def test_samples_and_the_models_size_bounds():
    from mhla_diffusion.embedded import embedded_model
    from mhla_diffusion.utils.geometry import MAX_SEED, VideoGeometry
    from mhla_diffusion.web.validation import VideoBounds, video_bounds

    assert video_request(**GOOD_VIDEO, samples=3).seeds == [3, 4, 5]
    for samples, message in (
        (0, "Samples 0 is out of range: use 1 to 8"),
        (9, "Samples 9 is out of range"),
        (2.5, "Samples must be a whole number"),
    ):
        with pytest.raises(DemoInputError, match=message):
            video_request(**GOOD_VIDEO, samples=samples)
    with pytest.raises(DemoInputError, match=f"Seed {MAX_SEED} with 2 samples needs seeds up to {MAX_SEED + 1}"):
        video_request(**{**GOOD_VIDEO, "seed": MAX_SEED}, samples=2)
    # the embedded model's position table ends at 256 px: the form offers no more (Wan2.1's: the demo's 1024)
    embedded = VideoGeometry.from_folder(embedded_model("text-to-video"))
    assert video_bounds(embedded) == VideoBounds(81, 16, 16, 256, 256)
    assert video_bounds(VideoGeometry()).max_height == 1024
    assert video_bounds(VideoGeometry(max_tokens_per_axis=8), Limits(max_size=100)) == VideoBounds(29, 16, 16, 96, 96)
    with pytest.raises(SystemExit):  # refused at parse time: the flag's range, from 1 to 8
        build_parser().parse_args(["--samples", "9"])


def test_model_sources_and_missing_folders(pipeline_dirs, tmp_path):
    dit, weights = str(pipeline_dirs["dit"]), pipeline_dirs["dit_mhla"]
    assert resolve_task_models("class-to-image", dit, weights, None, dit).softmax_source == "folder"
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_task_models("class-to-image", str(tmp_path / "nowhere"), None, None, None)
    with pytest.raises(FileNotFoundError, match="mhla-weights"):
        resolve_task_models("class-to-image", dit, tmp_path / "nowhere", None, None)
    with pytest.raises(ValueError, match="need --c2i-model"):
        resolve_task_models("class-to-image", None, weights, None, None)


def test_mhla_web_subcommand_exists():
    from mhla_diffusion.cli import build_parser as mhla_parser

    args = mhla_parser().parse_args(["web", "--port", "7000", "--no-preload"])
    assert args.command == "web" and args.port == 7000 and args.preload is False


def test_session_outputs_are_separate_and_cleaned(tmp_path):
    outputs = SessionOutputs(tmp_path / "root", max_age_s=60)
    frames = np.zeros((5, 16, 16, 3), dtype=np.float32)
    video = outputs.save_video("abc", frames, "mhla", fps=8)
    image = outputs.save_image("../evil", np.ones((16, 16, 3), dtype=np.float32), "softmax")
    assert video.parent == outputs.root / "abc" and video.suffix == ".mp4" and video.stat().st_size > 0
    assert image.parent.parent == outputs.root and image.suffix == ".png"  # session ids cannot escape the root
    stale = outputs.folder("old")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    outputs.folder("abc")  # any request sweeps folders unused for max_age_s
    assert not stale.exists() and video.exists()
    outputs.remove("abc")
    assert not video.parent.exists()
    outputs.remove_all()
    assert not outputs.root.exists()


def test_softmax_sources_agree(pipeline_dirs, tmp_path):
    """'same' (MHLA weights under softmax attention), 'base' and 'folder' give the base model's image."""
    from mhla_diffusion.pipelines import MHLADiTPipeline
    from mhla_diffusion.web.config import DemoConfig
    from mhla_diffusion.web.models import ModelStore

    dit, weights = str(pipeline_dirs["dit"]), pipeline_dirs["dit_mhla"]
    saved = tmp_path / "dit_mhla_pipeline"
    MHLADiTPipeline.from_pretrained(dit, mhla_weights=weights).save_pretrained(saved)
    video = resolve_task_models("text-to-video", str(pipeline_dirs["wan"]), pipeline_dirs["wan_mhla"], None, None)
    request = image_request("goldfish", 0, 2, 4.0, LABELS, 1000)
    images, steps = {}, []
    for source, task in (
        ("same", (str(saved), None, None, None)),
        ("base", (dit, weights, None, None)),
        ("folder", (str(saved), None, None, dit)),
    ):
        models = resolve_task_models("class-to-image", *task)
        assert models.softmax_source == source
        store = ModelStore(DemoConfig(video=video, image=models, defaults=None, device="cpu"))
        assert store.class_choices() == ["tench", "goldfish", "great white shark", "tiger shark", "hammerhead"]
        images[source] = store.generate_image(
            request, "softmax", progress=lambda step, total: steps.append((step, total))
        )
        mhla = store.generate_image(request, "mhla")
        assert not np.allclose(mhla.arrays[0], images[source].arrays[0])
    assert steps[:2] == [(1, 2), (2, 2)]
    np.testing.assert_allclose(images["same"].arrays[0], images["base"].arrays[0], atol=1e-5)
    np.testing.assert_allclose(images["same"].arrays[0], images["folder"].arrays[0], atol=1e-5)
