"""Tiny transformers of the other Diffusers families MHLA converts (SkyReels-V2, HunyuanVideo, LTX-Video,
CogVideoX, SANA-Video, Flux), built from the configs of Diffusers' own model tests: random weights, no downloads.

Each builder returns the model in eval mode and a matching forward input (``(args, kwargs)``) with
:func:`tiny_family_inputs`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = [
    "tiny_cogvideox_transformer",
    "tiny_family_inputs",
    "tiny_family_pipeline",
    "tiny_flux_transformer",
    "tiny_hunyuan_video_transformer",
    "tiny_ltx_video_transformer",
    "tiny_sana_video_transformer",
    "tiny_skyreels_v2_transformer",
]


#: The tiny configs (Diffusers' model tests' sizes), by family; ``num_layers`` is the builders' argument.
_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "skyreels-v2": dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ),
    "hunyuan-video": dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_single_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    ),
    "ltx-video": dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        qk_norm="rms_norm_across_heads", caption_channels=16,
    ),
    # CogVideoX 1.5's layout (RoPE, patch 2x2x2), with heads of 16 so that its 3-D RoPE splits evenly
    "cogvideox": dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=8, sample_width=8, sample_height=8, sample_frames=8, patch_size=2, patch_size_t=2,
        temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True,
    ),
    "sana-video": dict(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_cross_attention_heads=2,
        cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=16, mlp_ratio=2.5, dropout=0.0,
        attention_bias=False, sample_size=8, patch_size=(1, 2, 2), norm_elementwise_affine=False, norm_eps=1e-6,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ),
    "flux": dict(
        patch_size=1, in_channels=4, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    ),
}  # fmt: skip
_CLASSES = {
    "skyreels-v2": "SkyReelsV2Transformer3DModel",
    "hunyuan-video": "HunyuanVideoTransformer3DModel",
    "ltx-video": "LTXVideoTransformer3DModel",
    "cogvideox": "CogVideoXTransformer3DModel",
    "sana-video": "SanaVideoTransformer3DModel",
    "flux": "FluxTransformer2DModel",
}


def _build(family: str, num_layers: int, seed: int, overrides: dict[str, Any]) -> Any:
    import diffusers

    torch.manual_seed(seed)
    config = {**_TINY_CONFIGS[family], "num_layers": num_layers, **overrides}
    return getattr(diffusers, _CLASSES[family])(**config).eval()


def tiny_skyreels_v2_transformer(num_layers: int = 2, seed: int = 0, **overrides: Any) -> Any:
    """A ``SkyReelsV2Transformer3DModel``: 2 heads of 12, patch 1x2x2."""
    return _build("skyreels-v2", num_layers, seed, overrides)


def tiny_hunyuan_video_transformer(num_layers: int = 1, seed: int = 0, **overrides: Any) -> Any:
    """A ``HunyuanVideoTransformer3DModel``: 2 heads of 10, one double- and one single-stream block, patch 1."""
    return _build("hunyuan-video", num_layers, seed, overrides)


def tiny_ltx_video_transformer(num_layers: int = 1, seed: int = 0, **overrides: Any) -> Any:
    """An ``LTXVideoTransformer3DModel``: 2 heads of 8, patch 1."""
    return _build("ltx-video", num_layers, seed, overrides)


def tiny_cogvideox_transformer(num_layers: int = 2, seed: int = 0, **overrides: Any) -> Any:
    """A ``CogVideoXTransformer3DModel`` (1.5 layout: RoPE, patch 2x2x2): 2 heads of 16, 8 text tokens."""
    return _build("cogvideox", num_layers, seed, overrides)


def tiny_sana_video_transformer(num_layers: int = 2, seed: int = 0, **overrides: Any) -> Any:
    """A ``SanaVideoTransformer3DModel``: 2 heads of 12, patch 1x2x2."""
    return _build("sana-video", num_layers, seed, overrides)


def tiny_flux_transformer(num_layers: int = 1, seed: int = 0, **overrides: Any) -> Any:
    """A ``FluxTransformer2DModel``: 2 heads of 16, one double- and one single-stream block."""
    return _build("flux", num_layers, seed, overrides)


def tiny_family_inputs(
    family: str,
    grid: tuple[int, ...] = (2, 4, 6),
    batch: int = 2,
    seed: int = 0,
    text_length: int = 5,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of one random forward of a ``family`` transformer (the tiny one, or one with ``config``) on
    the token ``grid`` (frames, height, width; Flux: rows, columns), with ``text_length`` text tokens (HunyuanVideo:
    the last sample's prompt 2 tokens shorter, right-padded as its pipeline pads)."""
    config = config if config is not None else _TINY_CONFIGS[family]
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    timestep = torch.full((batch,), 500.0)
    channels = config.get("in_channels", 4)
    if family in ("skyreels-v2", "sana-video"):
        (pt, ph, pw), (f, h, w) = config.get("patch_size", (1, 2, 2)), grid
        text_dim = config["text_dim"] if family == "skyreels-v2" else config["caption_channels"]
        return dict(
            hidden_states=randn(batch, channels, f * pt, h * ph, w * pw),
            timestep=timestep,
            encoder_hidden_states=randn(batch, text_length, text_dim),
        )
    if family == "hunyuan-video":
        pt, p = config.get("patch_size_t", 1), config.get("patch_size", 2)
        f, h, w = grid
        mask = torch.ones(batch, text_length)
        mask[-1, text_length - 2 :] = 0
        guidance = dict(guidance=torch.full((batch,), 3.0)) if config.get("guidance_embeds", True) else {}
        return dict(
            hidden_states=randn(batch, channels, f * pt, h * p, w * p),
            timestep=timestep,
            encoder_hidden_states=randn(batch, text_length, config["text_embed_dim"]),
            encoder_attention_mask=mask,
            pooled_projections=randn(batch, config["pooled_projection_dim"]),
            **guidance,
        )
    if family == "ltx-video":
        f, h, w = grid
        return dict(
            hidden_states=randn(batch, f * h * w, channels),
            encoder_hidden_states=randn(batch, text_length, config["caption_channels"]),
            timestep=timestep.long(),
            encoder_attention_mask=torch.ones(batch, text_length, dtype=torch.bool),
            num_frames=f,
            height=h,
            width=w,
        )
    if family == "cogvideox":
        pt, p = config.get("patch_size_t") or 1, config["patch_size"]
        f, h, w = grid
        rotary = {}
        if config.get("use_rotary_positional_embeddings"):
            rotary = dict(image_rotary_emb=_cogvideox_rotary(grid, config["attention_head_dim"]))
        return dict(
            hidden_states=randn(batch, f * pt, channels, h * p, w * p),
            encoder_hidden_states=randn(batch, config["max_text_seq_length"], config["text_embed_dim"]),
            timestep=timestep.long(),
            **rotary,
        )
    if family == "flux":
        rows, columns = grid
        ids = torch.zeros(rows, columns, 3)
        ids[..., 1] += torch.arange(rows)[:, None]
        ids[..., 2] += torch.arange(columns)[None, :]
        guidance = dict(guidance=torch.full((batch,), 3.5)) if config.get("guidance_embeds") else {}
        return dict(
            hidden_states=randn(batch, rows * columns, channels),
            encoder_hidden_states=randn(batch, text_length, config["joint_attention_dim"]),
            pooled_projections=randn(batch, config["pooled_projection_dim"]),
            timestep=timestep / 1000,
            img_ids=ids.reshape(-1, 3),
            txt_ids=torch.zeros(text_length, 3),
            **guidance,
        )
    raise ValueError(f"no inputs for family {family!r}")


def _cogvideox_rotary(grid: tuple[int, int, int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CogVideoX's 3-D RoPE tables ``(N, head_dim)`` for a token grid, as its pipeline makes them."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    f, h, w = grid
    return get_3d_rotary_pos_embed(head_dim, (0, 0), (h, w), f, grid_type="slice", max_size=(h, w))


def _vocabulary(tokenizer) -> dict[str, int]:
    """A tiny text encoder's config entries for ``tokenizer``: its vocabulary size and special tokens (begin = end)."""
    return dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )


def tiny_family_pipeline(family: str, num_layers: int = 1, seed: int = 0) -> Any:
    """A complete stock Diffusers pipeline of ``family`` at toy size, every component built here (no downloads):
    ``"skyreels-v2"`` (``SkyReelsV2Pipeline``: Wan's tiny tokenizer, UMT5 encoder and VAE), ``"hunyuan-video"``
    (``HunyuanVideoPipeline``: a tiny Llama and CLIP text encoder with word-level tokenizers, the VAE of Diffusers'
    pipeline test) or ``"flux"`` (``FluxPipeline``: tiny CLIP and T5 encoders, the VAE of Diffusers' pipeline test,
    no latent compression: 32x32 px are 16x16 packed tokens). Each samples in a second or so on a CPU."""
    from .tiny import tiny_text_encoder, tiny_tokenizer, tiny_wan_vae

    if family == "skyreels-v2":
        from diffusers import SkyReelsV2Pipeline, UniPCMultistepScheduler

        tokenizer = tiny_tokenizer()
        return SkyReelsV2Pipeline(
            tokenizer=tokenizer,
            text_encoder=tiny_text_encoder(len(tokenizer), seed=seed),
            vae=tiny_wan_vae("2.1", seed=seed),
            transformer=tiny_skyreels_v2_transformer(num_layers, seed, in_channels=16, out_channels=16, text_dim=32),
            scheduler=UniPCMultistepScheduler(
                prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=8.0
            ),
        )
    if family == "hunyuan-video":
        from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
        from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

        tokenizer, tokenizer_2 = tiny_tokenizer(), tiny_tokenizer(max_length=77)
        words = _vocabulary(tokenizer)
        torch.manual_seed(seed)
        text_encoder = LlamaModel(
            LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_hidden_layers=3, **words)
        ).eval()
        text_encoder_2 = CLIPTextModel(
            CLIPTextConfig(
                hidden_size=8,
                intermediate_size=16,
                num_attention_heads=2,
                num_hidden_layers=2,
                projection_dim=8,
                **words,
            )
        ).eval()
        blocks = 4
        vae = AutoencoderKLHunyuanVideo(
            latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * blocks,
            up_block_types=("HunyuanVideoUpBlock3D",) * blocks,
            block_out_channels=(8,) * blocks,
            layers_per_block=1,
            norm_num_groups=4,
            scaling_factor=0.476986,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
        ).eval()
        return HunyuanVideoPipeline(
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=tiny_hunyuan_video_transformer(num_layers, seed),
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
        )
    if family == "flux":
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        tokenizer, tokenizer_2 = tiny_tokenizer(max_length=77), tiny_tokenizer()
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                hidden_size=32,
                intermediate_size=37,
                num_attention_heads=4,
                num_hidden_layers=2,
                projection_dim=32,
                **_vocabulary(tokenizer),
            )
        ).eval()
        text_encoder_2 = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        ).eval()
        vae = AutoencoderKL(
            block_out_channels=(4,),
            layers_per_block=1,
            latent_channels=1,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ).eval()
        return FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            transformer=tiny_flux_transformer(num_layers, seed),
        )
    raise ValueError(f"no tiny pipeline for family {family!r}: choose skyreels-v2, hunyuan-video or flux")
