"""The Wan family beyond Wan2.1 text-to-video, at toy size: Wan2.1-I2V, Wan2.2-TI2V-5B (text- and image-to-video),
Wan2.2-A14B (text- and image-to-video, two transformers). Generation with MHLA and with softmax, save / reload,
MHLA weights for two transformers, the image cross-attention, and the Wan2.2 VAE's geometry."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, WanImageToVideoPipeline, WanPipeline
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from helpers.models import seeded
from helpers.wan_family import (
    LAYOUT,
    RUNS,
    TWO_TRANSFORMERS,
    VARIANTS,
    call_args,
    first_frame,
    is_image_to_video,
    pipeline_class,
)
from mhla_diffusion import MHLAConfig, MHLAWanTransformer3DModel, get_mhla_conversion, revert_mhla
from mhla_diffusion.models.conversion import mhla_parameter_names
from mhla_diffusion.models.processors import WanMHLAProcessor
from mhla_diffusion.models.tiny import tiny_wan_pipeline
from mhla_diffusion.pipelines import MHLAWanImageToVideoPipeline, MHLAWanPipeline
from mhla_diffusion.utils.geometry import VideoGeometry


def load(dirs, variant: str, image_to_video: bool, mhla: bool = True, **kwargs):
    cls = pipeline_class(image_to_video)
    pipe = cls.from_pretrained(dirs[variant], mhla_weights=dirs[f"{variant}-mhla"] if mhla else None, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, variant: str, image_to_video: bool, **overrides) -> np.ndarray:
    return pipe(**{**call_args(variant, image_to_video), **overrides}, generator=seeded()).frames


@pytest.mark.parametrize("variant,image_to_video", RUNS, ids=[f"{v}-{'i2v' if i else 't2v'}" for v, i in RUNS])
def test_mhla_and_softmax_generate_deterministically_and_differ(wan_family_dirs, variant, image_to_video):
    pipe = load(wan_family_dirs, variant, image_to_video)
    names = ["transformer", "transformer_2"] if variant in TWO_TRANSFORMERS else ["transformer"]
    assert list(pipe.mhla_conversions) == names and pipe.mhla.layout == LAYOUT  # every transformer has MHLA
    mhla_a, mhla_b = generate(pipe, variant, image_to_video), generate(pipe, variant, image_to_video)
    grids = {name: t.blocks[0].attn1.processor.grid_context.grid for name, t in pipe.transformer_components.items()}
    with pipe.softmax_attention():
        assert not any(
            isinstance(block.attn1.processor, WanMHLAProcessor)
            for t in pipe.transformer_components.values()
            for block in t.blocks
        )
        softmax_a, softmax_b = generate(pipe, variant, image_to_video), generate(pipe, variant, image_to_video)
    size = call_args(variant, image_to_video)["height"]
    assert mhla_a.shape == (1, 9, size, size, 3)
    assert np.array_equal(mhla_a, mhla_b) and np.array_equal(softmax_a, softmax_b)
    assert np.abs(mhla_a - softmax_a).max() > 1e-3
    # every transformer ran MHLA on the latent video's token grid (3 latent frames of 2x2 tokens), whatever the
    # channels that enter it (36 for I2V: noisy latent + mask + image latent; 48 for TI2V-5B)
    if variant in TWO_TRANSFORMERS:
        assert grids["transformer_2"] == grids["transformer"]
    assert set(grids.values()) == {pipe.token_grid(9, size, size)} == {(3, 2, 2)}
    # softmax_attention() covers every transformer: the same as the model without MHLA
    plain = load(wan_family_dirs, variant, image_to_video, mhla=False)
    assert plain.mhla is None and np.array_equal(generate(plain, variant, image_to_video), softmax_a)


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_reloads_bit_exact_with_mhla(wan_family_dirs, tmp_path, variant):
    image_to_video = is_image_to_video(variant)
    pipe = load(wan_family_dirs, variant, image_to_video)
    # prompt embeddings instead of text: Diffusers 0.42's own WanImageToVideoPipeline needs `ftfy` for text
    call = {k: v for k, v in call_args(variant, image_to_video).items() if k not in ("prompt", "negative_prompt")}
    embeds, negative = pipe.encode_prompt(
        "a red circle moving left", "blue", max_sequence_length=call["max_sequence_length"]
    )
    call.update(prompt_embeds=embeds, negative_prompt_embeds=negative)
    expected = pipe(**call, generator=seeded()).frames
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == ("WanImageToVideoPipeline" if image_to_video else "WanPipeline")
    names = list(pipe.transformer_components)
    for name in names:
        assert index[name] == ["mhla_diffusion", "MHLAWanTransformer3DModel"]
        assert json.loads((tmp_path / "saved" / name / "config.json").read_text())["mhla"]["layout"] == list(LAYOUT)
    stock = WanImageToVideoPipeline if image_to_video else WanPipeline
    for cls in (pipeline_class(image_to_video), stock, DiffusionPipeline):  # stock loaders keep MHLA too
        reloaded = cls.from_pretrained(tmp_path / "saved")
        reloaded.set_progress_bar_config(disable=True)
        assert isinstance(reloaded, stock)
        for name in names:
            transformer = getattr(reloaded, name)
            assert isinstance(transformer, MHLAWanTransformer3DModel), (cls, name)
            assert get_mhla_conversion(transformer).layout == LAYOUT
            torch.testing.assert_close(
                transformer.blocks[0].attn1.processor.mixing,
                getattr(pipe, name).blocks[0].attn1.processor.mixing,
                rtol=0,
                atol=0,
            )
        assert np.array_equal(reloaded(**call, generator=seeded()).frames, expected), cls


def test_image_cross_attention_is_untouched():
    """Wan2.1-I2V: MHLA replaces attn1 only; attn2 keeps its processor and its image keys / values."""
    pipe = MHLAWanImageToVideoPipeline.from_pipe(tiny_wan_pipeline(variant="wan2.1-i2v"))
    pipe.set_progress_bar_config(disable=True)
    blocks = pipe.transformer.blocks
    processors = [block.attn2.processor for block in blocks]
    attn2_state = {k: v.clone() for k, v in pipe.transformer.state_dict().items() if ".attn2." in k}
    assert any(".attn2.add_k_proj." in k for k in attn2_state) and any(".attn2.norm_added_k." in k for k in attn2_state)
    pipe.convert_to_mhla(MHLAConfig(layout=LAYOUT))
    assert [block.attn2.processor for block in blocks] == processors
    assert all(type(p) is WanAttnProcessor for p in processors)
    assert all(isinstance(block.attn1.processor, WanMHLAProcessor) for block in blocks)
    assert all(".attn1.processor." in name for name in mhla_parameter_names(pipe.transformer))
    state = pipe.transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in attn2_state.items())
    # the image's CLIP tokens (16 patches + class token) reach those projections, and condition the video
    seen = []
    hook = blocks[0].attn2.add_k_proj.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    one = generate(pipe, "wan2.1-i2v", True)
    hook.remove()
    assert seen and set(seen) == {17}
    other = generate(pipe, "wan2.1-i2v", True, image=first_frame(32, seed=1))
    assert np.abs(one - other).max() > 1e-3
    # another text length would mix image and text tokens up in Diffusers' cross-attention: refused before work
    with pytest.raises(ValueError, match="max_sequence_length is 16 text tokens, but this image-to-video model"):
        generate(pipe, "wan2.1-i2v", True, max_sequence_length=16)


@pytest.mark.parametrize("variant", TWO_TRANSFORMERS)
def test_two_transformers_take_mhla_weights_in_either_form(wan_family_dirs, variant):
    image_to_video = is_image_to_video(variant)
    folder = wan_family_dirs[f"{variant}-mhla"]
    one_folder = load(wan_family_dirs, variant, image_to_video)
    two_folders = pipeline_class(image_to_video).from_pretrained(
        wan_family_dirs[variant], mhla_weights=folder / "transformer", mhla_weights_2=folder / "transformer_2"
    )
    two_folders.set_progress_bar_config(disable=True)
    for name in ("transformer", "transformer_2"):
        torch.testing.assert_close(
            getattr(two_folders, name).blocks[0].attn1.processor.mixing,
            getattr(one_folder, name).blocks[0].attn1.processor.mixing,
            rtol=0,
            atol=0,
        )
    mixing = [t.blocks[0].attn1.processor.mixing for t in one_folder.transformer_components.values()]
    assert not torch.equal(mixing[0], mixing[1])  # x1.5 and x0.5: each got its own weights
    assert np.array_equal(generate(one_folder, variant, image_to_video), generate(two_folders, variant, image_to_video))


def test_mhla_weights_that_miss_a_transformer_are_refused_before_loading(wan_family_dirs, monkeypatch):
    def no_loading(cls, *args, **kwargs):
        raise AssertionError("the pipeline was loaded before the MHLA weights were checked")

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", classmethod(no_loading))
    a14b, mhla = wan_family_dirs["wan2.2-a14b-t2v"], wan_family_dirs["wan2.2-a14b-t2v-mhla"]
    with pytest.raises(ValueError, match=r"only for transformer: pass mhla_weights_2=<folder> for transformer_2"):
        MHLAWanPipeline.from_pretrained(a14b, mhla_weights=mhla / "transformer")
    with pytest.raises(ValueError, match=r"already holds transformer_2/: leave out mhla_weights_2"):
        MHLAWanPipeline.from_pretrained(a14b, mhla_weights=mhla, mhla_weights_2=mhla / "transformer_2")
    with pytest.raises(ValueError, match=r"MHLA weights for transformer_2, but the pipeline has no transformer_2"):
        MHLAWanImageToVideoPipeline.from_pretrained(
            wan_family_dirs["wan2.1-i2v"],
            mhla_weights=wan_family_dirs["wan2.1-i2v-mhla"],
            mhla_weights_2=mhla / "transformer_2",
        )
    with pytest.raises(
        FileNotFoundError,
        match=r"mhla_weights .* is a WanPipeline pipeline folder .*: no mhla_config.json in it \(nor in its transf",
    ):
        MHLAWanPipeline.from_pretrained(a14b, mhla_weights=a14b)


def test_two_transformers_with_their_own_configs_and_the_boundary(wan_family_dirs, tmp_path):
    pipe = MHLAWanPipeline.from_pretrained(wan_family_dirs["wan2.2-a14b-t2v"])
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="`layout` .* must have 3 axes"):  # checked before either is converted
        pipe.convert_to_mhla(MHLAConfig(layout=LAYOUT), config_2=MHLAConfig(layout=(2, 2)))
    assert pipe.mhla is None
    conversions = pipe.convert_to_mhla(MHLAConfig(layout=LAYOUT), config_2=MHLAConfig(layout=(1, 2, 2), layers=[1]))
    assert conversions["transformer"].layout == LAYOUT and conversions["transformer_2"].layers == [1]
    with pytest.raises(
        ValueError, match=r"transformers differ in MHLA .*transformer_2: MHLA on layers \[1\], layout 1x2x2"
    ):
        pipe.mhla
    # boundary_ratio 0.875: step t=999 runs `transformer`, t=750 `transformer_2`
    # (twice each: with and without the prompt)
    calls = []
    handles = [
        t.register_forward_pre_hook(lambda module, args, name=name: calls.append(name))
        for name, t in pipe.transformer_components.items()
    ]
    frames = generate(pipe, "wan2.2-a14b-t2v", False)
    assert pipe.scheduler.timesteps.tolist() == [999, 750]
    assert calls == ["transformer", "transformer", "transformer_2", "transformer_2"]
    pipe.register_to_config(boundary_ratio=0.5)  # both steps are high-noise now
    calls.clear()
    generate(pipe, "wan2.2-a14b-t2v", False)
    assert calls == ["transformer"] * 4
    pipe.register_to_config(boundary_ratio=0.875)
    for handle in handles:
        handle.remove()
    pipe.save_pretrained(tmp_path / "saved")
    reloaded = MHLAWanPipeline.from_pretrained(tmp_path / "saved")
    reloaded.set_progress_bar_config(disable=True)
    assert {name: (c.layers, c.layout) for name, c in reloaded.mhla_conversions.items()} == {
        "transformer": ([0, 1], LAYOUT),
        "transformer_2": ([1], (1, 2, 2)),
    }
    assert reloaded.config.boundary_ratio == 0.875
    assert np.array_equal(generate(reloaded, "wan2.2-a14b-t2v", False), frames)
    pipe.save_mhla(tmp_path / "mhla")  # transformer/ and transformer_2/, each with its own config
    again = MHLAWanPipeline.from_pretrained(wan_family_dirs["wan2.2-a14b-t2v"], mhla_weights=tmp_path / "mhla")
    assert again.mhla_conversions == reloaded.mhla_conversions
    with pytest.raises(FileExistsError, match="already hold MHLA weights"):
        pipe.save_mhla(tmp_path / "mhla")
    revert_mhla(reloaded.transformer_2)
    assert reloaded.mhla_conversions["transformer_2"] is None
    with pytest.raises(ValueError, match="transformer_2: softmax"):
        reloaded.mhla
    with pytest.raises(ValueError, match="transformer_2 has no MHLA layers: convert it first"):
        reloaded.save_mhla(tmp_path / "partial")


def test_ti2v_geometry_comes_from_the_wan22_vae(wan_family_dirs):
    """Wan2.2-TI2V-5B's VAE (z_dim 48, residual, x16 in space): a token covers 32x32 pixels."""
    geometry = VideoGeometry.from_folder(wan_family_dirs["wan2.2-ti2v"])
    vae = json.loads((wan_family_dirs["wan2.2-ti2v"] / "vae" / "config.json").read_text())
    assert vae["z_dim"] == 48 and vae["is_residual"] and vae["scale_factor_spatial"] == 16
    assert geometry == VideoGeometry(4, 16, (1, 2, 2), 32) and geometry.size_multiple == (32, 32)
    assert geometry.token_grid(121, 704, 1280, strict=False) == (31, 22, 40)  # its native 720p clip
    pipe = load(wan_family_dirs, "wan2.2-ti2v", False)
    assert pipe.geometry == geometry and pipe.config.expand_timesteps
    with pytest.raises(
        ValueError, match=r"height 48 must be a positive multiple of 32 \(VAE x4 in time and x16 in space"
    ):
        generate(pipe, "wan2.2-ti2v", False, height=48)
    with pytest.raises(ValueError, match="width 1056 is larger than the model supports: at most 1024"):
        generate(pipe, "wan2.2-ti2v", False, width=1056)  # 32 RoPE positions x 32 px


def test_a_pipeline_holding_only_transformer_2(wan_family_dirs):
    """Diffusers lets either transformer of a two-transformer pipeline be left out: sizes and MHLA follow the other."""
    folder = wan_family_dirs["wan2.2-a14b-t2v"]
    pipe = MHLAWanPipeline.from_pretrained(
        folder, transformer=None, mhla_weights_2=wan_family_dirs["wan2.2-a14b-t2v-mhla"] / "transformer_2"
    )
    assert pipe.transformer is None and list(pipe.transformer_components) == ["transformer_2"]
    assert pipe.mhla.layout == LAYOUT
    assert pipe.geometry == VideoGeometry.from_folder(folder) and pipe.token_grid(9, 32, 32) == (3, 2, 2)
