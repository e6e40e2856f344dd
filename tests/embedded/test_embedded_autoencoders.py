"""The demo's tiny VAEs: latent shapes, a few training steps, the latent normalisation they store, pipelines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhla_diffusion.embedded import (
    generate_clips,
    latent_statistics,
    tiny_image_vae,
    tiny_video_vae,
    train_image_vae,
    train_video_vae,
)
from mhla_diffusion.embedded.judges.image_judge import images_to_tensor
from mhla_diffusion.embedded.judges.video_judge import clips_to_tensor
from mhla_diffusion.embedded.worlds.moving_shapes import FRAME_SIZE, NUM_FRAMES


def _small_clips(count: int = 2) -> np.ndarray:
    """``count`` moving-shapes clips cut to 5 frames and halved to 32x32 (so a training step takes ~0.1 s)."""
    clips, _, _ = generate_clips(count, seed=3)
    return np.ascontiguousarray(clips[:, :5, ::2, ::2])


@torch.no_grad()
def _l1(vae, pixels: torch.Tensor) -> float:
    """L1 between ``pixels`` and the decoding of their posterior means."""
    return float((vae.decode(vae.encode(pixels).latent_dist.mean).sample - pixels).abs().mean())


def test_video_vae_has_wan_compression():
    vae = tiny_video_vae()
    assert vae.config.scale_factor_spatial == 8 and vae.config.scale_factor_temporal == 4
    assert len(vae.config.latents_mean) == len(vae.config.latents_std) == vae.config.z_dim == 16
    assert 300_000 < sum(p.numel() for p in vae.parameters()) < 800_000  # ~1-3 MB of float32
    clips, _, _ = generate_clips(1, seed=0)
    with torch.no_grad():
        z = vae.encode(clips_to_tensor(clips)).latent_dist.mean
        assert z.shape == (1, 16, (NUM_FRAMES - 1) // 4 + 1, FRAME_SIZE // 8, FRAME_SIZE // 8)
        assert vae.decode(z).sample.shape == (1, 3, NUM_FRAMES, FRAME_SIZE, FRAME_SIZE)
    assert tiny_video_vae(z_dim=8).config.latents_mean == [0.0] * 8


@pytest.mark.slow
def test_video_vae_training_lowers_loss_and_stores_latent_statistics():
    clips = _small_clips()
    vae = tiny_video_vae(seed=1)
    pixels = clips_to_tensor(clips)
    before = _l1(vae, pixels)
    losses = train_video_vae(vae, clips, steps=12, batch_size=2, lr=5e-3, seed=0)
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert _l1(vae, pixels) < 0.7 * before
    assert not vae.training
    mean, std, _, _ = latent_statistics(vae, clips, clips_to_tensor)
    np.testing.assert_allclose(vae.config.latents_mean, mean, atol=1e-5)
    np.testing.assert_allclose(vae.config.latents_std, std, rtol=1e-4, atol=1e-6)
    # WanPipeline decodes z_model * std + mean, the Wan trainer encodes (z - mean) / std: unit per channel.
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mean
    shape = (1, -1, 1, 1, 1)
    z_model = (z - torch.tensor(vae.config.latents_mean).view(shape)) / torch.tensor(vae.config.latents_std).view(shape)
    torch.testing.assert_close(
        z_model.transpose(0, 1).flatten(1).std(1, unbiased=False), torch.ones(16), atol=1e-3, rtol=0
    )


def test_video_vae_decodes_inside_wan_pipeline():
    from mhla_diffusion.models.tiny import tiny_wan_pipeline

    base = tiny_wan_pipeline()
    pipe = type(base)(**{**base.components, "vae": tiny_video_vae()})
    assert pipe.vae_scale_factor_temporal == 4 and pipe.vae_scale_factor_spatial == 8
    pipe.set_progress_bar_config(disable=True)
    video = pipe(
        "a red circle moving left",
        num_frames=17,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=1.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert video.shape == (1, 17, 64, 64, 3)


@pytest.mark.slow
def test_image_vae_shapes_training_and_scaling_factor(digit_split):
    split = digit_split
    images = split.train_images[:64]
    vae = tiny_image_vae()
    pixels = images_to_tensor(images)
    with torch.no_grad():
        z = vae.encode(pixels[:2]).latent_dist.mean
        assert z.shape == (2, 4, 16, 16)
        assert vae.decode(z).sample.shape == (2, 3, 32, 32)
    before = _l1(vae, pixels)
    losses = train_image_vae(vae, images, steps=25, batch_size=16, lr=3e-3, seed=0)
    assert _l1(vae, pixels) < 0.5 * before
    _, _, _, std = latent_statistics(vae, images, images_to_tensor)
    assert abs(vae.config.scaling_factor - 1.0 / std) < 1e-4 * vae.config.scaling_factor
    assert getattr(vae.config, "shift_factor", None) is None  # DiTPipeline applies no shift
    again = tiny_image_vae()
    assert train_image_vae(again, images, steps=25, batch_size=16, lr=3e-3, seed=0) == losses  # deterministic


def test_image_vae_decodes_inside_dit_pipeline():
    from mhla_diffusion.models.tiny import tiny_dit_pipeline, tiny_dit_transformer

    base = tiny_dit_pipeline()
    pipe = type(base)(
        transformer=tiny_dit_transformer(sample_size=16, patch_size=2), vae=tiny_image_vae(), scheduler=base.scheduler
    )
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        class_labels=[0, 1],
        num_inference_steps=2,
        guidance_scale=1.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (2, 32, 32, 3)
