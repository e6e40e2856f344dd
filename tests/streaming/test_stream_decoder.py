"""The Wan VAE decoded chunk by chunk with its causal feature cache kept (pipelines/stream_decoder.py) equals
``vae.decode`` of the whole latent, for Wan2.1's VAE (the embedded one's shape) and Wan2.2's (patch size 2).

In float64, to 1e-12: the arithmetic is the same up to the order of float sums (the 1x1x1 post-quant convolution
runs on a chunk instead of the whole latent; in float32 that leaves differences of a few 1e-6)."""

from __future__ import annotations

import pytest
import torch

from mhla_diffusion.embedded.builds.autoencoders import tiny_video_vae
from mhla_diffusion.models.tiny import tiny_wan_vae
from mhla_diffusion.pipelines.stream_decoder import WanStreamingDecoder

VAES = {"embedded": tiny_video_vae, "wan2.1": lambda: tiny_wan_vae("2.1"), "wan2.2": lambda: tiny_wan_vae("2.2")}


@pytest.mark.parametrize("vae_name", sorted(VAES))
@pytest.mark.parametrize("chunks", [(1, 2, 3, 1), (3, 4)])
def test_chunk_by_chunk_equals_one_decode(vae_name, chunks):
    vae = VAES[vae_name]().double()
    latents = torch.randn(
        1, vae.config.z_dim, sum(chunks), 2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    with torch.no_grad():
        whole = vae.decode(latents).sample
    decoder = WanStreamingDecoder(vae)
    parts, start = [], 0
    for size in chunks:
        parts.append(decoder.decode(latents[:, :, start : start + size]))
        start += size
    assert [p.shape[2] for p in parts] == [4 * size - (3 if i == 0 else 0) for i, size in enumerate(chunks)]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=0, atol=1e-12)
    # a later chunk decoded on its own (a fresh cache) is not the same: the cache is what carries the frames before
    alone = WanStreamingDecoder(vae).decode(latents[:, :, chunks[0] :])
    assert (alone[:, :, -1] - whole[:, :, -1]).abs().max() > 1e-3


def test_a_tiled_vae_is_refused():
    vae = tiny_video_vae()
    vae.enable_tiling()
    with pytest.raises(ValueError, match=r"vae.disable_tiling\(\)"):
        WanStreamingDecoder(vae)
