"""Tiny transformers of the other Diffusers families MHLA converts (SkyReels-V2, HunyuanVideo, LTX-Video,
CogVideoX, SANA-Video, Flux), built from the configs of Diffusers' own model tests: random weights, no downloads.

Each builder returns the model in eval mode and a matching forward input (``(args, kwargs)``) with
:func:`tiny_family_inputs`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "tiny_cogvideox_transformer",
    "tiny_family_inputs",
    "tiny_flux_transformer",
    "tiny_hunyuan_video_transformer",
    "tiny_ltx_video_transformer",
    "tiny_sana_video_transformer",
    "tiny_skyreels_v2_transformer",
]


def _build(class_name: str, config: dict[str, Any], overrides: dict[str, Any], seed: int) -> Any:
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, class_name)(**{**config, **overrides}).eval()


def tiny_skyreels_v2_transformer(num_layers: int = 2, seed: int = 0, **overrides: Any) -> Any:
    """A ``SkyReelsV2Transformer3DModel``: 2 heads of 12, patch 1x2x2."""
    config = dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    return _build("SkyReelsV2Transformer3DModel", config, overrides, seed)


def tiny_hunyuan_video_transformer(num_layers: int = 1, seed: int = 0, **overrides: Any) -> Any:
    """A ``HunyuanVideoTransformer3DModel``: 2 heads of 10, one double- and one single-stream block, patch 1."""
    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=num_layers,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    )  # fmt: skip
    return _build("HunyuanVideoTransformer3DModel", config, overrides, seed)


def tiny_ltx_video_transformer(num_layers: int = 1, seed: int = 0, **overrides: Any) -> Any:
    """An ``LTXVideoTransformer3DModel``: 2 heads of 8, patch 1."""
    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        num_layers=num_layers, qk_norm="rms_norm_across_heads", caption_channels=16,
    )  # fmt: skip
    return _build("LTXVideoTransformer3DModel", config, overrides, seed)


def tiny_cogvideox_transformer(num_layers: int = 2, seed: int = 0, **overrides: Any) -> Any:
    """A ``CogVideoXTransformer3DModel`` (1.5 layout: RoPE, patch 2x2x2): 2 heads of 16, 8 text tokens."""
    config = dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=8, num_layers=num_layers, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
        patch_size_t=2, temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True,
    )  # fmt: skip
    return _build("CogVideoXTransformer3DModel", config, overrides, seed)


def tiny_sana_video_transformer(num_layers: int = 2, seed: int = 0, **overrides: Any) -> Any:
    """A ``SanaVideoTransformer3DModel``: 2 heads of 12, patch 1x2x2."""
    config = dict(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=num_layers,
        num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=16,
        mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8, patch_size=(1, 2, 2),
        norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    return _build("SanaVideoTransformer3DModel", config, overrides, seed)


def tiny_flux_transformer(num_layers: int = 1, seed: int = 0, **overrides: Any) -> Any:
    """A ``FluxTransformer2DModel``: 2 heads of 16, one double- and one single-stream block."""
    config = dict(
        patch_size=1, in_channels=4, num_layers=num_layers, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )  # fmt: skip
    return _build("FluxTransformer2DModel", config, overrides, seed)


def tiny_family_inputs(family: str, grid: tuple[int, ...] = (2, 4, 6), batch: int = 2, seed: int = 0,
                       text_length: int = 5) -> dict[str, Any]:  # fmt: skip
    """Keyword arguments of one forward of the tiny ``family`` transformer on the token ``grid`` (frames, height,
    width; Flux: rows, columns), with ``text_length`` text tokens (the second sample's prompt 2 shorter where
    the family takes a text mask)."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    timestep = torch.tensor([500.0] * batch)
    if family == "skyreels-v2":
        f, h, w = grid
        return dict(hidden_states=randn(batch, 4, f, 2 * h, 2 * w), timestep=timestep,
                    encoder_hidden_states=randn(batch, text_length, 16))  # fmt: skip
    if family == "sana-video":
        f, h, w = grid
        return dict(hidden_states=randn(batch, 16, f, 2 * h, 2 * w), timestep=timestep,
                    encoder_hidden_states=randn(batch, text_length, 16))  # fmt: skip
    if family == "hunyuan-video":
        mask = torch.ones(batch, text_length)
        mask[-1, text_length - 2 :] = 0  # right-padded, as HunyuanVideoPipeline pads
        return dict(hidden_states=randn(batch, 4, *grid), timestep=timestep, encoder_hidden_states=randn(batch, text_length, 16),
                    encoder_attention_mask=mask, pooled_projections=randn(batch, 8), guidance=torch.tensor([3.0] * batch))  # fmt: skip
    if family == "ltx-video":
        f, h, w = grid
        return dict(hidden_states=randn(batch, f * h * w, 4), encoder_hidden_states=randn(batch, text_length, 16),
                    timestep=timestep.long(), encoder_attention_mask=torch.ones(batch, text_length, dtype=torch.bool),
                    num_frames=f, height=h, width=w)  # fmt: skip
    if family == "cogvideox":
        f, h, w = grid
        return dict(hidden_states=randn(batch, 2 * f, 4, 2 * h, 2 * w), encoder_hidden_states=randn(batch, 8, 8),
                    timestep=timestep.long(), image_rotary_emb=_cogvideox_rotary((f, h, w), 16))  # fmt: skip
    if family == "flux":
        rows, columns = grid
        ids = torch.zeros(rows, columns, 3)
        ids[..., 1] += torch.arange(rows)[:, None]
        ids[..., 2] += torch.arange(columns)[None, :]
        return dict(hidden_states=randn(batch, rows * columns, 4), encoder_hidden_states=randn(batch, text_length, 32),
                    pooled_projections=randn(batch, 32), timestep=timestep / 1000, img_ids=ids.reshape(-1, 3),
                    txt_ids=torch.zeros(text_length, 3))  # fmt: skip
    raise ValueError(f"no tiny inputs for family {family!r}")


def _cogvideox_rotary(grid: tuple[int, int, int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CogVideoX's 3-D RoPE tables ``(N, head_dim)`` for a token grid, as its pipeline makes them."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    f, h, w = grid
    return get_3d_rotary_pos_embed(head_dim, (0, 0), (h, w), f, grid_type="slice", max_size=(h, w))
