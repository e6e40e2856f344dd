"""VAE posteriors in the transformer's latent space, and latents drawn from them.

The VAE posterior ``N(mean, exp(logvar))`` is mapped through the model's latent normalisation
``z -> (z - shift) * scale`` (an affine map, so the result is again Gaussian) and kept as
``params = cat(mean, logvar)`` over channels, ``(B, 2C, ...)``. Latents are then a draw
``mean + exp(logvar / 2) * noise`` (``latent_sampling: sample``) or the mean (``mode``). The cache
stores ``params`` (or just the mean for ``mode``), so a cached run draws exactly what an online run
draws from the same generator. ``presampled`` (DiT's released recipe: pre-extracted latents) stores
one draw per image, made once by the cache pre-pass (:func:`presample`) and used at every step.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

__all__ = ["draw_latents", "encode_posterior", "presample", "wan_latent_normalization", "dit_latent_normalization"]


def wan_latent_normalization(vae: nn.Module, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan: ``z_model = (z - latents_mean) / latents_std`` per channel (inverse of ``WanPipeline``'s decode)."""
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, channels, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, channels, 1, 1, 1)
    return mean, 1.0 / std


def dit_latent_normalization(vae: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """SD-VAE (DiT): ``z_model = (z - shift_factor) * scaling_factor`` (shift 0 when the config has none)."""
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return torch.tensor(float(shift)), torch.tensor(float(vae.config.scaling_factor))


@torch.no_grad()
def encode_posterior(vae: nn.Module, pixels: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``pixels`` in ``[-1, 1]`` (Wan ``(B, 3, F, H, W)``, DiT ``(B, 3, H, W)``) -> float32 params ``(B, 2C, ...)``."""
    weight = next(vae.parameters())
    posterior = vae.encode(pixels.to(weight.device, weight.dtype)).latent_dist
    mean, logvar = posterior.mean.float(), posterior.logvar.float()
    shift, scale = shift.to(mean.device), scale.to(mean.device)
    mean = (mean - shift) * scale
    logvar = logvar + 2.0 * torch.log(scale.abs())
    return torch.cat([mean, logvar], dim=1)


def draw_latents(stored: torch.Tensor, channels: int, sampling: str, generator: torch.Generator | None) -> torch.Tensor:
    """Latents ``(B, C, ...)`` from stored params ``(B, 2C, ...)`` or a stored mean ``(B, C, ...)``."""
    stored = stored.float()
    if sampling == "presampled":
        if stored.shape[1] != channels:
            raise ValueError(
                "latent_sampling: presampled needs a cache of drawn latents (built with presampled); "
                "use another cache_dir"
            )
        return stored
    if stored.shape[1] == channels:
        if sampling == "sample":
            raise ValueError(
                "the cache holds posterior means only (built with latent_sampling: mode); "
                "use latent_sampling: mode or another cache_dir"
            )
        return stored
    mean, logvar = stored[:, :channels], stored[:, channels:]
    if sampling == "mode":
        return mean
    noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + torch.exp(0.5 * logvar) * noise


def presample(params: torch.Tensor, channels: int, identity: Any) -> torch.Tensor:
    """One latent ``(C, ...)`` drawn from the posterior ``params`` ``(2C, ...)`` of one image, with noise
    seeded by ``identity`` (JSON-able: the image and view), so every process and every rebuild of the
    cache draws the same latent for it."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return draw_latents(params[None].float().cpu(), channels, "sample", generator)[0]
