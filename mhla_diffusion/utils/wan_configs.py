"""Published full-size ``WanTransformer3DModel`` configs (Diffusers 0.42), as plain dicts.

The values are those of Diffusers' own Wan conversion script and the ``transformer/config.json`` of
the ``Wan-AI/*-Diffusers`` repositories: every keyword of ``WanTransformer3DModel.__init__``, so
``WanTransformer3DModel(**config)`` builds the model (on the meta device for a model that does not
fit in memory: see :func:`mhla_diffusion.loaders.original_wan.empty_wan_transformer`). Nothing here
imports torch; the dicts returned by :func:`wan_transformer_config` are fresh copies.

Shared by every entry: ``attention_head_dim`` 128 (``num_attention_heads x 128`` is the model width),
``patch_size`` (1, 2, 2), ``text_dim`` 4096 (umT5-XXL), ``freq_dim`` 256, ``cross_attn_norm`` True,
``qk_norm`` ``"rms_norm_across_heads"``, ``eps`` 1e-6, ``rope_max_seq_len`` 1024. Image-to-video models
take 36 input channels: 16 noisy latent + 4 mask + 16 condition latent.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "WAN21_FLF2V_14B_720P",
    "WAN21_I2V_14B_480P",
    "WAN21_I2V_14B_720P",
    "WAN21_T2V_14B",
    "WAN21_T2V_1_3B",
    "WAN22_I2V_A14B",
    "WAN22_T2V_A14B",
    "WAN22_TI2V_5B",
    "WAN_TRANSFORMER_CONFIGS",
    "wan_transformer_config",
]


def _config(
    heads: int,
    layers: int,
    ffn_dim: int,
    in_channels: int = 16,
    out_channels: int = 16,
    image_dim: int | None = None,
    added_kv_proj_dim: int | None = None,
    pos_embed_seq_len: int | None = None,
) -> dict[str, Any]:
    """A full ``WanTransformer3DModel`` keyword dict from the values that differ between Wan models."""
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": heads,
        "attention_head_dim": 128,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": ffn_dim,
        "num_layers": layers,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": image_dim,
        "added_kv_proj_dim": added_kv_proj_dim,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": pos_embed_seq_len,
    }


WAN21_T2V_1_3B: dict[str, Any] = _config(heads=12, layers=30, ffn_dim=8960)
"""Wan2.1-T2V-1.3B: text-to-video, width 1536 (12 heads), 30 blocks, FFN 8960; ~1.42 B parameters.
The model the MHLA paper converts (and whose MHLA checkpoint it released)."""

WAN21_T2V_14B: dict[str, Any] = _config(heads=40, layers=40, ffn_dim=13824)
"""Wan2.1-T2V-14B: text-to-video, width 5120 (40 heads), 40 blocks, FFN 13824; ~14.3 B parameters."""

WAN21_I2V_14B_480P: dict[str, Any] = _config(
    heads=40, layers=40, ffn_dim=13824, in_channels=36, image_dim=1280, added_kv_proj_dim=5120
)
"""Wan2.1-I2V-14B-480P: image-to-video, the T2V-14B body with 36 input channels, a CLIP ViT-H image
embedder (``image_dim`` 1280, 257 image tokens) and in every block's cross-attention a second
key/value projection for the image tokens (``added_kv_proj_dim`` 5120)."""

WAN21_I2V_14B_720P: dict[str, Any] = _config(
    heads=40, layers=40, ffn_dim=13824, in_channels=36, image_dim=1280, added_kv_proj_dim=5120
)
"""Wan2.1-I2V-14B-720P: the same transformer config as the 480P model (trained for 720p)."""

WAN21_FLF2V_14B_720P: dict[str, Any] = _config(
    heads=40, layers=40, ffn_dim=13824, in_channels=36, image_dim=1280, added_kv_proj_dim=5120, pos_embed_seq_len=514
)
"""Wan2.1-FLF2V-14B-720P: first-last-frame-to-video; as I2V plus a learned position table over the
2 x 257 image tokens of the first and last frame (``pos_embed_seq_len`` 514)."""

WAN22_T2V_A14B: dict[str, Any] = _config(heads=40, layers=40, ffn_dim=13824)
"""Wan2.2-T2V-A14B: text-to-video with **two** transformers of this config (``transformer`` for the
high-noise steps, ``transformer_2`` for the rest; pipeline ``boundary_ratio`` 0.875)."""

WAN22_I2V_A14B: dict[str, Any] = _config(heads=40, layers=40, ffn_dim=13824, in_channels=36)
"""Wan2.2-I2V-A14B: image-to-video with two transformers of this config (``boundary_ratio`` 0.9); the
image enters only as concatenated latents (36 channels): no CLIP image embedder, no image keys/values."""

WAN22_TI2V_5B: dict[str, Any] = _config(heads=24, layers=30, ffn_dim=14336, in_channels=48, out_channels=48)
"""Wan2.2-TI2V-5B: one model for text- and image-to-video, width 3072 (24 heads), 30 blocks, FFN 14336,
48 latent channels of the Wan2.2 VAE (16x spatial compression); the pipeline runs it with
``expand_timesteps=True`` (per-token timesteps)."""

#: Every published config by its model name (the ``Wan-AI`` repository name without ``-Diffusers``).
WAN_TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "Wan2.1-T2V-1.3B": WAN21_T2V_1_3B,
    "Wan2.1-T2V-14B": WAN21_T2V_14B,
    "Wan2.1-I2V-14B-480P": WAN21_I2V_14B_480P,
    "Wan2.1-I2V-14B-720P": WAN21_I2V_14B_720P,
    "Wan2.1-FLF2V-14B-720P": WAN21_FLF2V_14B_720P,
    "Wan2.2-T2V-A14B": WAN22_T2V_A14B,
    "Wan2.2-I2V-A14B": WAN22_I2V_A14B,
    "Wan2.2-TI2V-5B": WAN22_TI2V_5B,
}


def wan_transformer_config(name: str) -> dict[str, Any]:
    """A copy of the published config ``name`` (e.g. ``"Wan2.1-I2V-14B-480P"``; case and a
    ``Wan-AI/`` prefix or ``-Diffusers`` suffix are ignored); ``ValueError`` lists the known names."""
    key = name.strip()
    key = key[len("Wan-AI/") :] if key.lower().startswith("wan-ai/") else key
    key = key[: -len("-Diffusers")] if key.lower().endswith("-diffusers") else key
    by_lower = {known.lower(): known for known in WAN_TRANSFORMER_CONFIGS}
    if key.lower() not in by_lower:
        raise ValueError(
            f"no published Wan transformer config named {name!r}; known: {', '.join(WAN_TRANSFORMER_CONFIGS)}"
        )
    return dict(WAN_TRANSFORMER_CONFIGS[by_lower[key.lower()]])
