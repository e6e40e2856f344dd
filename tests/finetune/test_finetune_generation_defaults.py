"""A pipeline the trainers save records the settings it was trained with, so `mhla text-to-video --model
<run>/pipeline` needs no size, and its guidance, steps and frame rate follow the model it started from."""

from __future__ import annotations

import json

import pytest

from helpers.finetune import dit_options, wan_options
from helpers.models import with_record
from mhla_diffusion.cli import main
from mhla_diffusion.finetune import train_dit, train_wan
from mhla_diffusion.finetune.train_wan import WanTask
from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline
from mhla_diffusion.utils.model_defaults import RECORD_KEY


@pytest.mark.slow
def test_a_trained_wan_pipeline_generates_with_no_flags(tmp_path, pipeline_dirs, video_set, capsys):
    base = with_record(pipeline_dirs["wan"], tmp_path / "base", {"guidance_scale": 2.0, "num_inference_steps": 3})
    options = wan_options(
        base, video_set, tmp_path / "run", max_train_steps=1, save_pipeline=True, height=16, flow_shift=7.0
    )
    train_wan.train(options)
    folder = tmp_path / "run" / "pipeline"
    index = json.loads((folder / "model_index.json").read_text())
    assert index[RECORD_KEY] == {
        "num_frames": 9,
        "height": 16,
        "width": 32,
        "max_sequence_length": 16,
        "guidance_scale": 2.0,  # the validation guidance, by default the base model's
        "num_inference_steps": 3,  # the base model's
        "fps": 16,  # Diffusers' default: the base records none
    }
    assert json.loads((folder / "scheduler" / "scheduler_config.json").read_text())["flow_shift"] == 7.0
    assert MHLAWanPipeline.from_pretrained(folder).config[RECORD_KEY] == index[RECORD_KEY]  # load and save keep it

    out = tmp_path / "out"
    assert main(["text-to-video", "--model", str(folder), "--prompt", "a red square", "--output-dir", str(out)]) == 0
    (sidecar,) = out.glob("*.json")
    settings = json.loads(sidecar.read_text())
    assert (settings["num_frames"], settings["height"], settings["width"]) == (9, 16, 32)
    assert (settings["guidance_scale"], settings["num_inference_steps"], settings["flow_shift"]) == (2.0, 3, 7.0)


def test_the_validation_guidance_is_what_the_pipeline_records(tmp_path, pipeline_dirs, video_set):
    base = with_record(pipeline_dirs["wan"], tmp_path / "base", {"guidance_scale": 2.0})
    given = WanTask(wan_options(base, video_set, tmp_path / "a", validation_guidance_scale=4.5))
    assert given.generation_defaults()["guidance_scale"] == 4.5
    unrecorded = WanTask(wan_options(pipeline_dirs["wan"], video_set, tmp_path / "b"))
    assert unrecorded.generation_defaults()["guidance_scale"] == 5.0  # WanPipeline's own default


@pytest.mark.slow
def test_a_trained_dit_pipeline_records_its_guidance_and_steps(tmp_path, pipeline_dirs, image_classes):
    base = with_record(pipeline_dirs["dit"], tmp_path / "base", {"num_inference_steps": 4})
    train_dit.train(
        dit_options(
            base, image_classes, tmp_path / "run", max_train_steps=1, save_pipeline=True, validation_guidance_scale=1.5
        )
    )
    folder = tmp_path / "run" / "pipeline"
    record = json.loads((folder / "model_index.json").read_text())[RECORD_KEY]
    assert record == {"guidance_scale": 1.5, "num_inference_steps": 4}
    assert MHLADiTPipeline.from_pretrained(folder).config[RECORD_KEY] == record
