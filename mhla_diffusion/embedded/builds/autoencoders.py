"""Tiny VAEs for the demo models, trained here from scratch on the demo data (no downloads).

* :func:`tiny_video_vae` / :func:`train_video_vae`: a Diffusers ``AutoencoderKLWan`` with Wan2.1's
  compression by default (8x spatial, 4x temporal: a 17x64x64 clip -> latents ``(z_dim, 5, 8, 8)``; the
  build compresses less, ``build.VIDEO_VAE``) for the moving-shapes clips; training stores the per-channel
  mean / std of the posterior means as ``latents_mean`` / ``latents_std``, which ``WanPipeline`` decodes
  with (``z * std + mean``) and the Wan trainer encodes with (``(z - mean) / std``,
  :mod:`mhla_diffusion.finetune.latents`).
* :func:`tiny_image_vae` / :func:`train_image_vae`: a Diffusers ``AutoencoderKL`` with 2x
  downsampling for the 32x32 digits (latents ``(4, 16, 16)``); training stores
  ``scaling_factor = 1 / std`` of the posterior means, which ``DiTPipeline`` decodes with
  (``z / scaling_factor``) and the DiT trainer encodes with (``z * scaling_factor``; no shift).

Both are trained on reconstruction (L1 + MSE in ``[-1, 1]`` pixels, the video's shape pixels up-weighted)
of a posterior sample plus a small KL term, AdamW with warm-up and cosine decay, deterministic given ``seed``.
The video VAE trains on random 9x32x32 crops by default (more clips per CPU second).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ...training.loop import LoopProgress, epoch_batch, run_loop, step_generator
from ...utils.geometry import VideoGeometry
from ..judges.image_judge import images_to_tensor, tensor_to_uint8
from ..judges.video_judge import clips_to_tensor
from ..worlds.digits import DIGIT_SIZE
from ..worlds.moving_shapes import BACKGROUND

__all__ = [
    "latent_statistics",
    "psnr",
    "reconstruct_clips",
    "reconstruct_images",
    "tiny_image_vae",
    "tiny_video_vae",
    "train_image_vae",
    "train_video_vae",
]


def tiny_video_vae(seed: int = 0, **overrides) -> "AutoencoderKLWan":  # noqa: F821
    """An ``AutoencoderKLWan`` with Wan2.1's 8x spatial / 4x temporal compression at toy width.

    Encoder widths 8-16-32-32 (``base_dim`` 8, ``dim_mult`` [1, 2, 4, 4]), one residual block per level,
    ``z_dim`` 16 (Wan2.1's, so a Wan transformer keeps ``in_channels`` 16). ``overrides`` replace config entries.
    """
    from diffusers import AutoencoderKLWan

    config = dict(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    config.update(overrides)
    if len(config["dim_mult"]) != len(config["temperal_downsample"]) + 1:
        raise ValueError("dim_mult needs one more entry than temperal_downsample")
    spatial = 2 ** len(config["temperal_downsample"])
    temporal = 2 ** sum(bool(t) for t in config["temperal_downsample"])
    config.setdefault("scale_factor_spatial", spatial)
    config.setdefault("scale_factor_temporal", temporal)
    config.setdefault("latents_mean", [0.0] * config["z_dim"])
    config.setdefault("latents_std", [1.0] * config["z_dim"])
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**config)
    _start_with_small_variance(vae.quant_conv, vae.config.z_dim)
    return vae.eval()


def tiny_image_vae(seed: int = 0, **overrides) -> "AutoencoderKL":  # noqa: F821
    """An ``AutoencoderKL`` for 32x32 RGB with one 2x downsampling (2 blocks) -> latents ``(4, 16, 16)``.

    Widths 16-32, one ResNet layer per block, GroupNorm with 4 groups (~168k parameters, 0.7 MB).
    ``overrides`` replace config entries.
    """
    from diffusers import AutoencoderKL

    config = dict(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=DIGIT_SIZE,
        scaling_factor=1.0,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    vae = AutoencoderKL(**config)
    _start_with_small_variance(vae.quant_conv, vae.config.latent_channels)
    return vae.eval()


def _start_with_small_variance(quant_conv: torch.nn.Module, channels: int, logvar: float = -6.0) -> None:
    """Bias the posterior's log-variance half to ``logvar``: with the default 0 the posterior noise (std 1)
    drowns the still tiny means at the start and the decoder learns from noise for hundreds of steps."""
    with torch.no_grad():
        quant_conv.bias[channels:] = logvar


def _decode_video_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLWan._decode`` without its final clamp to ``[-1, 1]`` (which would stop gradients)."""
    if getattr(vae.config, "patch_size", None) is not None or not hasattr(vae, "clear_cache"):
        return vae.decode(z).sample
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        frames.append(
            vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        )
    vae.clear_cache()
    return torch.cat(frames, dim=2)


def _kl(posterior) -> torch.Tensor:
    """Mean (over latent elements) KL divergence of the posterior from N(0, 1)."""
    return 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()


def _reconstruction_loss(recon: torch.Tensor, target: torch.Tensor, foreground_weight: float) -> torch.Tensor:
    """L1 + MSE, pixels away from the background weighted ``1 + foreground_weight`` (weights normalised to mean 1).

    The background is each sample's per-channel median; a pixel is foreground where some channel is more
    than 0.1 from it. Without this a small shape on a plain background lets the VAE sit in the
    "background everywhere" minimum of the L1 loss for hundreds of steps.
    """
    error = (recon - target).abs()
    error = error + error.pow(2)
    if not foreground_weight:
        return error.mean()
    background = target.flatten(2).median(dim=2).values.view(*target.shape[:2], *([1] * (target.dim() - 2)))
    weight = 1.0 + foreground_weight * ((target - background).abs().amax(dim=1, keepdim=True) > 0.1).float()
    return (error * weight).mean() / weight.mean()


def _fit(
    vae,
    num_items: int,
    load: Callable[[np.ndarray, int], torch.Tensor],
    decode: Callable,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    kl_weight: float,
    foreground_weight: float,
    progress: LoopProgress | None,
    name: str,
) -> list[float]:
    """The loop both VAEs share (``load(indices, step)`` gives a batch); returns the (weighted)
    reconstruction loss of every step. Batches, crops and posterior samples are drawn from per-step
    seeds, so a run resumed from a checkpoint equals an uninterrupted one."""
    if steps < 1 or batch_size < 1 or lr <= 0 or num_items < 1:
        raise ValueError(f"need steps, batch_size, data >= 1 and lr > 0, got {steps}, {batch_size}, {num_items}, {lr}")
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=1e-4)
    warmup = max(1, min(50, steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * s / steps))
    )

    def loss_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = load(epoch_batch(step, batch_size, num_items, seed), step)
        posterior = vae.encode(x).latent_dist
        recon = decode(posterior.sample(generator=step_generator(seed, step, 1)))
        rec = _reconstruction_loss(recon, x, foreground_weight)
        return rec + kl_weight * _kl(posterior), rec

    vae.train()
    losses = run_loop(name, steps, loss_fn, vae, optimizer, schedule, progress, clip_norm=1.0).losses
    vae.eval()
    return losses


@torch.no_grad()
def latent_statistics(
    vae, pixels: np.ndarray, to_tensor: Callable[[np.ndarray], torch.Tensor], batch_size: int = 32
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Posterior means of uint8 ``pixels`` -> (per-channel mean, per-channel std, overall mean, overall std)."""
    count = 0
    sums = squares = None
    for start in range(0, len(pixels), batch_size):
        z = vae.encode(to_tensor(pixels[start : start + batch_size])).latent_dist.mean.double()
        z = z.transpose(0, 1).reshape(z.shape[1], -1)  # (C, everything else)
        sums = z.sum(1) if sums is None else sums + z.sum(1)
        squares = z.pow(2).sum(1) if squares is None else squares + z.pow(2).sum(1)
        count += z.shape[1]
    mean, second = sums / count, squares / count
    std = (second - mean.pow(2)).clamp_min(0).sqrt()
    total_mean = float(mean.mean())
    total_std = float((second.mean() - total_mean**2) ** 0.5)
    return mean.numpy(), std.numpy(), total_mean, total_std


def train_video_vae(
    vae,
    clips: np.ndarray,
    steps: int,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    kl_weight: float = 1e-4,
    foreground_weight: float = 10.0,
    crop_frames: int = 9,
    crop_size: int = 32,
    centre_crops: bool = False,
    progress: LoopProgress | None = None,
) -> list[float]:
    """Train an ``AutoencoderKLWan`` on uint8 ``clips`` ``(N, F, H, W, 3)``; returns the per-step reconstruction losses.

    Loss: L1 + MSE between the clip and the decoding of a posterior sample, both in ``[-1, 1]``, plus
    ``kl_weight`` times the mean KL to N(0, 1). Each step trains on ``crop_frames`` x ``crop_size`` x
    ``crop_size`` crops of its clips (each at most the clips' size; 0 = no crop), at a random time; with
    ``centre_crops`` each crop is centred (give or take 4 pixels) on where the shape is in those frames,
    so that every crop teaches the VAE a shape rather than plain background. Convolutions do not care
    where in the frame they run, and crops cost a fraction of whole clips on a CPU budget. Afterwards
    the per-channel mean and std of the posterior means over ``clips`` become ``vae.config.latents_mean`` /
    ``latents_std`` (``WanPipeline``'s normalisation). ``progress``: bar and resumable checkpoint.
    """
    clips = np.asarray(clips)
    if clips.dtype != np.uint8 or clips.ndim != 5 or clips.shape[-1] != 3:
        raise ValueError(f"clips must be uint8 (N, F, H, W, 3), got {clips.dtype} {clips.shape}")
    geometry = VideoGeometry.of_vae(vae.config)
    if not geometry.valid_frames(clips.shape[1]):
        raise ValueError(f"clips need {geometry.frame_rule()} frames, got {clips.shape[1]}")
    frames, height, width = clips.shape[1:4]
    crop_frames, crop_size = min(crop_frames or frames, frames), min(crop_size or height, height, width)
    multiple = geometry.size_multiple[0]
    if (
        not geometry.valid_frames(crop_frames)
        or crop_frames > frames
        or crop_size % multiple
        or crop_size > min(height, width)
    ):
        raise ValueError(
            f"crop_frames must be {geometry.frame_rule()} <= {frames} and crop_size a multiple of {multiple} "
            f"<= {min(height, width)} ({geometry.describe()})"
        )

    def corner(window: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
        """Top-left corner of the crop of one clip's frames ``(f, H, W, 3)``."""
        if not centre_crops:
            return int(rng.integers(0, height - crop_size + 1)), int(rng.integers(0, width - crop_size + 1))
        ys, xs = np.nonzero((np.abs(window.astype(np.int16) - np.array(BACKGROUND)).max(-1) > 25).any(0))
        cy, cx = (ys.mean(), xs.mean()) if len(ys) else (height / 2, width / 2)
        jy, jx = rng.integers(-4, 5, size=2)
        return (
            int(np.clip(round(cy - crop_size / 2) + jy, 0, height - crop_size)),
            int(np.clip(round(cx - crop_size / 2) + jx, 0, width - crop_size)),
        )

    def load(pick: np.ndarray, step: int) -> torch.Tensor:
        rng = np.random.default_rng([seed, step, 2])
        t = int(rng.integers(0, frames - crop_frames + 1))
        crops = []
        for i in pick:
            window = clips[i, t : t + crop_frames]
            y, x = corner(window, rng)
            crops.append(window[:, y : y + crop_size, x : x + crop_size])
        return clips_to_tensor(np.ascontiguousarray(np.stack(crops)))

    torch.manual_seed(seed)
    losses = _fit(
        vae,
        len(clips),
        load,
        lambda z: _decode_video_unclamped(vae, z),
        steps,
        batch_size,
        lr,
        seed,
        kl_weight,
        foreground_weight,
        progress,
        "video VAE",
    )
    mean, std, _, _ = latent_statistics(vae, clips, clips_to_tensor, batch_size=16)
    vae.register_to_config(
        latents_mean=[round(float(m), 6) for m in mean], latents_std=[round(max(float(s), 1e-6), 6) for s in std]
    )
    return losses


def train_image_vae(
    vae,
    images: np.ndarray,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    kl_weight: float = 1e-4,
    foreground_weight: float = 0.0,
    progress: LoopProgress | None = None,
) -> list[float]:
    """Train an ``AutoencoderKL`` on uint8 ``images`` ``(N, H, W, 3)``; returns the per-step reconstruction losses.

    Same loss as :func:`train_video_vae`; ``progress``: bar and resumable checkpoint. Afterwards
    ``vae.config.scaling_factor`` is ``1 / std`` of the
    posterior means over ``images`` (all channels together) and ``shift_factor`` stays unset: ``DiTPipeline``
    decodes ``z / scaling_factor`` and applies no shift.
    """
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
    torch.manual_seed(seed)
    data = images_to_tensor(images)
    losses = _fit(
        vae,
        len(images),
        lambda pick, step: data[torch.from_numpy(pick)],
        lambda z: vae.decode(z).sample,
        steps,
        batch_size,
        lr,
        seed,
        kl_weight,
        foreground_weight,
        progress,
        "image VAE",
    )
    _, _, _, std = latent_statistics(vae, images, images_to_tensor, batch_size=256)
    vae.register_to_config(scaling_factor=round(1.0 / max(std, 1e-6), 6))
    return losses


@torch.no_grad()
def _reconstruct(
    vae, pixels: np.ndarray, to_tensor: Callable[[np.ndarray], torch.Tensor], batch_size: int
) -> np.ndarray:
    """uint8 channels-last ``pixels`` -> their decoded posterior means, uint8 of the same shape."""
    out = []
    for start in range(0, len(pixels), batch_size):
        z = vae.encode(to_tensor(pixels[start : start + batch_size])).latent_dist.mean
        out.append(tensor_to_uint8(vae.decode(z).sample))
    return np.concatenate(out) if out else np.zeros_like(pixels)


def psnr(reference: np.ndarray, reconstruction: np.ndarray) -> float:
    """Peak signal-to-noise ratio (dB) of uint8 ``reconstruction`` against uint8 ``reference`` (same shape),
    over all pixels together."""
    if reference.shape != reconstruction.shape:
        raise ValueError(f"shapes differ: {reference.shape} vs {reconstruction.shape}")
    mse = float(np.mean((reference.astype(np.float64) - reconstruction.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * float(np.log10(255.0**2 / mse))


def reconstruct_clips(vae, clips: np.ndarray, batch_size: int = 16) -> np.ndarray:
    """uint8 clips ``(N, F, H, W, 3)`` -> their decoded posterior means, uint8 of the same shape."""
    return _reconstruct(vae, clips, clips_to_tensor, batch_size)


def reconstruct_images(vae, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """uint8 images ``(N, H, W, 3)`` -> their decoded posterior means, uint8 of the same shape."""
    return _reconstruct(vae, images, images_to_tensor, batch_size)
