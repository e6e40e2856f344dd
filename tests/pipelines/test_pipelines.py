"""MHLAWanPipeline / MHLADiTPipeline on tiny pipelines saved to disk."""

from __future__ import annotations

import json

import numpy as np
import pytest
from diffusers import (
    DiffusionPipeline,
    DiTPipeline,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    WanPipeline,
)

from helpers.models import WAN_CALL, seeded
from mhla_diffusion import MHLADiTTransformer2DModel, MHLAWanTransformer3DModel
from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline


def load_wan(dirs, **kwargs):
    pipe = MHLAWanPipeline.from_pretrained(dirs["wan"], mhla_weights=dirs["wan_mhla"], **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_wan_mhla_vs_sdpa_differ_and_are_deterministic(pipeline_dirs):
    pipe = load_wan(pipeline_dirs)
    assert pipe.mhla.layers == [0, 1]
    mhla_a = pipe(**WAN_CALL, generator=seeded()).frames
    mhla_b = pipe(**WAN_CALL, generator=seeded()).frames
    with pipe.softmax_attention():
        sdpa_a = pipe(**WAN_CALL, generator=seeded()).frames
        sdpa_b = pipe(**WAN_CALL, generator=seeded()).frames
    assert mhla_a.shape == (1, 9, 32, 32, 3)
    assert np.array_equal(mhla_a, mhla_b) and np.array_equal(sdpa_a, sdpa_b)
    assert np.abs(mhla_a - sdpa_a).max() > 1e-3
    stock = WanPipeline.from_pretrained(pipeline_dirs["wan"])
    stock.set_progress_bar_config(disable=True)
    assert np.array_equal(stock(**WAN_CALL, generator=seeded()).frames, sdpa_a)


def test_wan_save_reload_is_bit_exact_with_every_loader(pipeline_dirs, tmp_path):
    pipe = load_wan(pipeline_dirs)
    expected = pipe(**WAN_CALL, generator=seeded()).frames
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["transformer"] == ["mhla_diffusion", "MHLAWanTransformer3DModel"]
    for cls in (MHLAWanPipeline, WanPipeline, DiffusionPipeline):  # stock loaders keep MHLA too
        reloaded = cls.from_pretrained(tmp_path / "saved")
        reloaded.set_progress_bar_config(disable=True)
        assert isinstance(reloaded.transformer, MHLAWanTransformer3DModel), cls
        assert reloaded.transformer.blocks[0].attn1.processor.gate is not None
        assert np.array_equal(reloaded(**WAN_CALL, generator=seeded()).frames, expected), cls


def test_wan_diffusers_features_keep_working(pipeline_dirs):
    pipe = load_wan(pipeline_dirs)
    steps = []

    def on_step(p, i, t, tensors):
        steps.append((i, tuple(tensors["latents"].shape)))
        return tensors

    out = pipe(**WAN_CALL, generator=seeded(), callback_on_step_end=on_step).frames
    assert [i for i, _ in steps] == [0, 1] and steps[0][1] == (1, 16, 3, 4, 4)
    # prompt_embeds instead of text
    embeds, negative = pipe.encode_prompt("a red circle moving left", "blue", max_sequence_length=16)
    call = {k: v for k, v in WAN_CALL.items() if k not in ("prompt", "negative_prompt")}
    by_embeds = pipe(**call, prompt_embeds=embeds, negative_prompt_embeds=negative, generator=seeded()).frames
    np.testing.assert_allclose(by_embeds, out, atol=1e-6)
    # swap the scheduler, as with any Diffusers pipeline
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=3.0)
    euler = pipe(**WAN_CALL, generator=seeded()).frames
    assert euler.shape == out.shape and np.abs(euler - out).max() > 0
    latents = pipe(**{**WAN_CALL, "output_type": "latent"}, generator=seeded()).frames
    assert latents.shape == (1, 16, 3, 4, 4)


def test_wan_generates_an_image_sized_grid_smaller_than_the_layout(pipeline_dirs):
    """One frame (token grid (1, 2, 2)) under the 2x2x2 layout: the second frame block is empty."""
    pipe = load_wan(pipeline_dirs)
    assert pipe.mhla.layout == (2, 2, 2) and pipe.token_grid(1, 32, 32) == (1, 2, 2)
    frames = pipe(**{**WAN_CALL, "num_frames": 1}, generator=seeded()).frames
    assert frames.shape == (1, 1, 32, 32, 3) and np.isfinite(frames).all()


def test_dit_pipeline_names_callback_and_reload(pipeline_dirs, tmp_path):
    pipe = MHLADiTPipeline.from_pretrained(pipeline_dirs["dit"], mhla_weights=pipeline_dirs["dit_mhla"])
    pipe.set_progress_bar_config(disable=True)
    assert pipe.class_ids(["goldfish", "Tinca tinca", 4, "3"]) == [1, 0, 4, 3]
    with pytest.raises(ValueError, match="unknown class names"):
        pipe(["blue whale"])
    with pytest.raises(ValueError, match="out of range"):
        pipe([1000])
    seen = []
    images = pipe(
        ["goldfish", 2],
        num_inference_steps=3,
        output_type="np",
        generator=seeded(),
        callback_on_step_end=lambda p, i, t, d: seen.append(i) or d,
    ).images
    assert images.shape == (2, 16, 16, 3) and seen == [0, 1, 2]
    plain = pipe(["goldfish", 2], num_inference_steps=3, output_type="np", generator=seeded()).images
    assert np.array_equal(images, plain)
    with pipe.softmax_attention():
        softmax = pipe(["goldfish", 2], num_inference_steps=3, output_type="np", generator=seeded()).images
    assert np.abs(softmax - plain).max() > 1e-4

    pipe.save_pretrained(tmp_path / "saved")
    for cls in (MHLADiTPipeline, DiTPipeline):
        reloaded = cls.from_pretrained(tmp_path / "saved")
        reloaded.set_progress_bar_config(disable=True)
        assert isinstance(reloaded.transformer, MHLADiTTransformer2DModel)
        assert reloaded.labels["goldfish"] == 1  # id2label survives the save
        again = reloaded([1, 2], num_inference_steps=3, output_type="np", generator=seeded()).images
        assert np.array_equal(again, plain), cls
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    assert pipe([1], num_inference_steps=3, output_type="np", generator=seeded()).images.shape == (1, 16, 16, 3)


def test_mhla_weights_into_converted_model_is_an_error(pipeline_dirs, tmp_path):
    pipe = load_wan(pipeline_dirs)
    pipe.save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="already converted"):
        MHLAWanPipeline.from_pretrained(tmp_path / "saved", mhla_weights=pipeline_dirs["wan_mhla"])


def test_stock_transformer_class_on_saved_folder_is_not_silent(pipeline_dirs, tmp_path, caplog):
    from diffusers import WanTransformer3DModel
    from diffusers.utils import logging as diffusers_logging

    load_wan(pipeline_dirs).save_pretrained(tmp_path / "saved")
    diffusers_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            WanTransformer3DModel.from_pretrained(tmp_path / "saved", subfolder="transformer")
    finally:
        diffusers_logging.disable_propagation()
    assert "attn1.processor.mixing" in caplog.text  # Diffusers names the MHLA weights it did not use
