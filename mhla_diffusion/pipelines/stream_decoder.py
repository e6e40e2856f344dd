"""Decoding Wan latents chunk by chunk, exactly as one ``AutoencoderKLWan.decode`` of the whole latent.

Diffusers' ``AutoencoderKLWan`` decodes one latent frame at a time through causal 3-D convolutions, each of
which reads the last frames of its input from a feature cache (``feat_cache``); ``decode`` clears that cache at
its start and end. :class:`WanStreamingDecoder` keeps its own cache from one call to the next instead, so the
frames of chunk after chunk come out as the whole clip's would (the very first latent frame is decoded with
``first_chunk=True``, as ``decode`` does). Memory: one cache of a few frames per causal convolution, whatever
the length.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WanStreamingDecoder"]


class WanStreamingDecoder:
    """Decodes a Wan latent video chunk by chunk; the concatenated chunks equal ``vae.decode`` of the whole.

    ``vae``: an ``AutoencoderKLWan`` (Wan2.1's, or Wan2.2's with ``patch_size``). Latents go in as ``vae.decode``
    takes them (already un-normalised with the VAE's ``latents_mean`` / ``latents_std``). One decoder per video.

    Tiling is not used: frames are decoded whole, one latent frame at a time, as ``decode`` does without
    ``enable_tiling()``; a VAE with tiling enabled is refused rather than decoded differently.
    """

    def __init__(self, vae: nn.Module) -> None:
        if getattr(vae, "use_tiling", False):
            raise ValueError(
                "the streaming decoder decodes whole frames, one latent frame at a time, so it would not match "
                "this VAE's tiled decode: call vae.disable_tiling() before streaming"
            )
        self.vae = vae
        self.latent_frames = 0  # latent frames decoded so far
        convolutions = vae._cached_conv_counts["decoder"]  # the causal convolutions that read the cache
        self._cache: list[torch.Tensor | None] = [None] * convolutions

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The next chunk: latents ``(B, z_dim, F, h, w)`` -> video ``(B, 3, F', H, W)`` in ``[-1, 1]``.

        ``F' = 1 + t (F - 1)`` for the first chunk of the video and ``t F`` for later ones (``t``: the VAE's
        temporal factor, 4).
        """
        vae = self.vae
        hook = getattr(vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):  # model CPU offload: bring the VAE in, as decode does
            hook.pre_forward(vae)
        x = vae.post_quant_conv(latents)  # a 1x1x1 convolution: frame by frame
        frames = []
        for index in range(x.shape[2]):
            frames.append(
                vae.decoder(
                    x[:, :, index : index + 1],
                    feat_cache=self._cache,
                    feat_idx=[0],
                    first_chunk=self.latent_frames == 0,
                )
            )
            self.latent_frames += 1
        out = torch.cat(frames, dim=2)
        if vae.config.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=vae.config.patch_size)
        return out.clamp_(-1.0, 1.0)
