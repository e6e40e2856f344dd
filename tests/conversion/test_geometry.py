"""``mhla_diffusion.utils.geometry``: pixels -> latents -> tokens, checked against arithmetic, against the
embedded model's configs and against what Diffusers' Wan and DiT models really do."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from mhla_diffusion.utils.geometry import (
    WAN_PIPELINE_SIZE_MULTIPLE,
    ImageGeometry,
    VideoGeometry,
    check_layout_fits,
    image_token_grid,
    validate_grid_layout,
    video_token_grid,
)


def test_defaults_are_wan21_and_missing_config_entries_keep_them():
    wan = VideoGeometry()
    assert (
        wan == VideoGeometry.from_configs({}, {}) == VideoGeometry.from_configs(None, {"scale_factor_temporal": None})
    )
    assert (wan.vae_scale_temporal, wan.vae_scale_spatial, wan.patch_size, wan.max_tokens_per_axis) == (
        4,
        8,
        (1, 2, 2),
        1024,
    )
    assert wan.token_grid(81, 480, 832) == video_token_grid(81, 480, 832) == (21, 30, 52)
    assert wan.size_multiple == wan.generation_multiple == (16, 16)
    assert wan.max_size() == (4093, 16384, 16384)
    assert wan.frame_rule() == "4k+1 (1, 5, 9, 13, ...)" and wan.frame_rule(examples=False) == "4k+1"
    assert wan.describe() == "VAE x4 in time and x8 in space, patch 1x2x2"
    assert VideoGeometry.from_folder("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == wan  # a hub id: no local configs
    assert ImageGeometry() == ImageGeometry.from_configs({}, {}) and image_token_grid(256, 256) == (16, 16)
    assert VideoGeometry(max_tokens_per_axis=None).max_size() is None


def _random_geometry(rng: random.Random) -> VideoGeometry:
    return VideoGeometry(
        rng.choice([1, 2, 4]),
        rng.choice([4, 8, 16]),
        (rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4])),
        rng.choice([None, 8, 64]),
    )


def test_random_sizes_follow_the_arithmetic():
    rng = random.Random(0)
    valid_draws = 0
    for _ in range(2000):
        g = _random_geometry(rng)
        t, s, (pt, ph, pw) = g.vae_scale_temporal, g.vae_scale_spatial, g.patch_size
        # half the draws near the rules (k * t + 1 frames, multiples of the step), half anything
        frames = rng.choice([rng.randint(-2, 300), t * rng.randint(0, 60) + 1])
        height = rng.choice([rng.randint(-8, 1200), s * ph * rng.randint(0, 80)])
        width = rng.choice([rng.randint(-8, 1200), s * pw * rng.randint(0, 80)])
        latent_frames = (frames - 1) // t + 1
        limit = math.inf if g.max_tokens_per_axis is None else g.max_tokens_per_axis
        valid = (
            frames >= 1
            and (frames - 1) % t == 0
            and latent_frames % pt == 0
            and latent_frames // pt <= limit
            and all(
                size >= step and size % step == 0 and size // step <= limit
                for size, step in ((height, s * ph), (width, s * pw))
            )
        )
        if valid:
            valid_draws += 1
            expected = (latent_frames // pt, height // (s * ph), width // (s * pw))
            assert g.token_grid(frames, height, width) == expected
            if g.max_tokens_per_axis is None:
                assert video_token_grid(frames, height, width, g.patch_size, (t, s, s)) == expected
        else:
            with pytest.raises(ValueError, match=re.escape(g.describe())):
                g.token_grid(frames, height, width)
        assert g.valid_frames(frames) == (frames >= 1 and (frames - 1) % t == 0 and latent_frames % pt == 0)
        if frames >= 1:  # Diffusers' WanPipeline rule, whatever the count
            assert g.round_frames(frames) == (frames if frames % t == 1 else frames // t * t + 1)
    assert valid_draws > 100


def test_edge_sizes():
    wan = VideoGeometry()
    assert wan.token_grid(1, 16, 16) == (1, 1, 1)  # the smallest clip: one image, one patch
    assert wan.token_grid(*wan.max_size()) == (1024, 1024, 1024)
    for size in ((0, 16, 16), (2, 16, 16), (1, 0, 16), (1, 16, -16), (1, 8, 16), (4097, 16, 16), (1, 16400, 16)):
        with pytest.raises(ValueError):
            wan.token_grid(*size)
    # strict=False takes any size as WanPipeline does: frames rounded (8 -> 9, 0 -> 1), sizes floored
    assert wan.token_grid(8, 40, 40, strict=False) == (3, 2, 2)
    assert wan.token_grid(0, 16, 16, strict=False) == wan.token_grid(-3, 16, 16, strict=False) == (1, 1, 1)
    assert [wan.round_frames(n) for n in (1, 4, 5, 7, 8, 81, 82)] == [1, 5, 5, 5, 9, 81, 81]
    with pytest.raises(ValueError, match="need at least 1"):
        wan.round_frames(0)
    # a temporal patch of 2: latent frames must pair up
    paired = VideoGeometry(patch_size=(2, 2, 2))
    assert [n for n in range(1, 30) if paired.valid_frames(n)] == [5, 13, 21, 29] == paired.example_frames()
    assert paired.frame_rule() == "4k+1 with latent frames divisible by 2 (5, 13, 21, 29, ...)"
    with pytest.raises(ValueError, match="`vae_scale`"):
        video_token_grid(9, 32, 32, vae_scale=(4, 8, 4))


def test_errors_name_the_models_factors():
    x4 = VideoGeometry.from_configs(
        {"patch_size": [1, 2, 2], "rope_max_seq_len": 64}, {"scale_factor_temporal": 4, "scale_factor_spatial": 4}
    )
    assert x4.size_multiple == (8, 8) and x4.max_size() == (253, 512, 512)
    x4.check_size(17, 72, 64)  # 8 px multiples make whole patches ...
    with pytest.raises(
        ValueError,
        match=r"height 72 must be a positive multiple of 16 \(VAE x4 in time and x4 in space, "
        r"patch 1x2x2; Diffusers' WanPipeline needs multiples of 16\)",
    ):
        x4.check_size(17, 72, 64, generation=True)  # ... but WanPipeline wants 16
    assert x4.generation_multiple == (WAN_PIPELINE_SIZE_MULTIPLE,) * 2
    with pytest.raises(ValueError, match=r"width 60 must be a positive multiple of 8 \(VAE x4 in time and x4 in space"):
        x4.check_size(17, 64, 60)
    with pytest.raises(
        ValueError,
        match=r"width 520 is larger than the model supports: at most 512 \(its position "
        r"encoding holds 64 tokens per axis",
    ):
        x4.check_size(17, 64, 520)
    odd = VideoGeometry(vae_scale_temporal=2, vae_scale_spatial=4, patch_size=(2, 1, 1), max_tokens_per_axis=None)
    with pytest.raises(
        ValueError,
        match=r"5 frames is not supported: use 2k\+1 with latent frames divisible by 2 "
        r"\(3, 7, 11, 15, ...\) \(VAE x2 in time and x4 in space, patch 2x1x1\)",
    ):
        odd.check_size(5, 4, 4)
    assert odd.token_grid(7, 4, 12) == (2, 1, 3) and odd.generation_multiple == (16, 16)
    with pytest.raises(ValueError, match=r"height 18 must be a positive multiple of 4 \(VAE x2, patch 2\)"):
        ImageGeometry(2, 2).token_grid(18, 16)


def test_vae_alone_and_pipeline_folders(pipeline_dirs):
    vae_only = VideoGeometry.of_vae({"scale_factor_temporal": 4, "scale_factor_spatial": 4, "z_dim": 8})
    assert vae_only.size_multiple == (4, 4) and vae_only.max_size() is None and vae_only.valid_frames(9)
    tiny = VideoGeometry.from_folder(pipeline_dirs["wan"])  # tiny Wan: Wan2.1's factors, RoPE of 32 positions
    assert tiny == VideoGeometry(max_tokens_per_axis=32) and tiny.max_size() == (125, 512, 512)
    assert ImageGeometry.from_folder(pipeline_dirs["dit"]) == ImageGeometry(vae_scale=2, patch_size=2)


def test_embedded_model_geometry():
    from mhla_diffusion.embedded import embedded_model

    try:
        folder = embedded_model("text-to-video", "mhla")
    except FileNotFoundError:
        pytest.skip("embedded models not built")
    geometry = VideoGeometry.from_folder(folder)
    assert geometry == VideoGeometry(2, 2, (1, 2, 2), 64)
    assert geometry.token_grid(9, 48, 48) == (5, 12, 12)  # the build's 5x12x12 grid for its 1x4x4 layout


def test_grid_against_layout():
    assert validate_grid_layout([3, 4, 4], [1, 2, 2], num_tokens=48) == ((3, 4, 4), (1, 2, 2))
    check_layout_fits((3, 4, 4), (3, 4, 4), "a video")
    # a grid smaller than the layout is fine: the extra blocks are empty
    assert validate_grid_layout([1, 2, 2], [2, 2, 2]) == ((1, 2, 2), (2, 2, 2))
    check_layout_fits((1, 2, 2), (2, 2, 2), "a 1x32x32 video")
    with pytest.raises(ValueError, match=r"`layout` \(0, 2\) has fewer than 1 block on axis \[0\]"):
        validate_grid_layout((4, 4), (0, 2))
    with pytest.raises(
        ValueError,
        match=r"an image has token grid \(4, 4\), which the MHLA block layout \(2, 2, 2\) "
        r"cannot cut: `layout` \(2, 2, 2\) has 3 axes",
    ):
        check_layout_fits((4, 4), (2, 2, 2), "an image")
    # the released DiT denominator still needs equal blocks, so no empty ones
    check_layout_fits((4, 4), (2, 2), "an image", "scalar_mixed_denominator")
    with pytest.raises(
        ValueError,
        match=r"needs equal-size blocks, but the block layout \(2, 2, 2\) does not divide "
        r"the token grid of a 1x32x32 video \(1, 2, 2\)",
    ):
        check_layout_fits((1, 2, 2), (2, 2, 2), "a 1x32x32 video", "scalar_mixed_denominator")


def test_max_size_is_the_position_encodings_limit():
    """One token past ``max_size`` on any axis breaks Diffusers' Wan forward; ``check_size`` refuses it first."""
    from mhla_diffusion.models.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(num_layers=1, rope_max_seq_len=4)
    geometry = VideoGeometry.from_configs(model.config)
    frames, height, width = geometry.max_size()
    assert (frames, height, width) == (13, 64, 64)

    def forward(f: int, h: int, w: int) -> None:
        latent = geometry.latent_shape(f, h, w)
        with torch.no_grad():
            model(
                hidden_states=torch.randn(1, 16, *latent),
                timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 3, 32),
            )

    geometry.check_size(frames, height, width)
    forward(frames, height, width)
    t, s, (pt, ph, pw) = geometry.vae_scale_temporal, geometry.vae_scale_spatial, geometry.patch_size
    for past in ((frames + pt * t, height, width), (frames, height + ph * s, width), (frames, height, width + pw * s)):
        with pytest.raises(ValueError, match="larger than the model supports"):
            geometry.check_size(*past)
        with pytest.raises(RuntimeError):
            forward(*past)


def test_token_grid_is_what_mhla_processors_see():
    """The grid MHLA layers get in a real tiny ``WanPipeline`` call (Diffusers rounding the frames and
    flooring the sizes) equals ``token_grid``; likewise for a DiT forward and ``image_token_grid``."""
    from mhla_diffusion import MHLAConfig, convert_to_mhla
    from mhla_diffusion.models.tiny import tiny_dit_transformer, tiny_wan_pipeline

    pipe = tiny_wan_pipeline(num_layers=1)
    pipe.set_progress_bar_config(disable=True)
    convert_to_mhla(pipe.transformer, MHLAConfig(layout=(1, 1, 1)))
    geometry = VideoGeometry.from_pipeline(pipe)
    seen = []

    def record(module, args, kwargs, output):
        processor = module.processor
        seen.append((processor.grid_context.grid, kwargs.get("hidden_states", args[0] if args else None).shape[1]))

    pipe.transformer.blocks[0].attn1.register_forward_hook(record, with_kwargs=True)
    for frames, height, width in ((9, 32, 32), (8, 32, 48), (13, 48, 16), (1, 16, 16), (6, 64, 32)):
        seen.clear()
        pipe(
            prompt="a red circle",
            num_frames=frames,
            height=height,
            width=width,
            num_inference_steps=1,
            guidance_scale=1.0,
            max_sequence_length=8,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
        grid = geometry.token_grid(frames, height, width, strict=False)
        assert seen and all(g == grid and n == math.prod(grid) for g, n in seen), (frames, height, width, seen)
        if geometry.valid_frames(frames):
            assert geometry.token_grid(frames, height, width) == grid

    dit = tiny_dit_transformer(num_layers=1)
    convert_to_mhla(dit, MHLAConfig())
    seen.clear()
    dit.transformer_blocks[0].attn1.register_forward_hook(record, with_kwargs=True)
    image = ImageGeometry.from_configs(dit.config, {"block_out_channels": [8, 16]})  # the tiny DiT pipeline's VAE x2
    side = int(dit.config.sample_size) * image.vae_scale
    with torch.no_grad():
        dit(torch.randn(1, 4, 8, 8), timestep=torch.tensor([10]), class_labels=torch.tensor([1]))
    assert seen == [(image.token_grid(side, side), 16)] and image_token_grid(side, side, 2, 2) == (4, 4)
