"""Tiny Wan and DiT transformers built from configs (no downloads), for demos and tests.

They have the real architectures at toy width, so conversion, save/load and the processors run
exactly as on Wan2.1-1.3B or DiT-XL/2, in milliseconds on a CPU.
"""

from __future__ import annotations

import torch

__all__ = ["tiny_dit_transformer", "tiny_wan_transformer"]


def tiny_wan_transformer(num_layers: int = 2, seed: int = 0, **overrides) -> "WanTransformer3DModel":  # noqa: F821
    """A ``WanTransformer3DModel`` with 2 heads of dim 12 (RoPE needs head_dim divisible by 6)."""
    from diffusers import WanTransformer3DModel

    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return WanTransformer3DModel(**config).eval()


def tiny_dit_transformer(num_layers: int = 2, seed: int = 0, **overrides) -> "DiTTransformer2DModel":  # noqa: F821
    """A ``DiTTransformer2DModel`` (learned sigma, 1000 classes) on an 8x8 latent with patch 2."""
    from diffusers import DiTTransformer2DModel

    config = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=num_layers,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_zero",
        norm_elementwise_affine=False,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return DiTTransformer2DModel(**config).eval()
