"""Tiny Wan and DiT transformers and pipelines built from configs (no downloads), for demos and tests.

They have the real architectures at toy width, so conversion, save/load and the processors run
exactly as on Wan2.1-1.3B, the other Wan models of Diffusers (:data:`WAN_VARIANTS`: image-to-video,
Wan2.2-TI2V-5B, Wan2.2-A14B) or DiT-XL/2, in milliseconds on a CPU.
"""

from __future__ import annotations

import torch

__all__ = [
    "TINY_ID2LABEL",
    "WAN_VARIANTS",
    "tiny_clip_vision",
    "tiny_dit_pipeline",
    "tiny_dit_transformer",
    "tiny_text_encoder",
    "tiny_tokenizer",
    "tiny_wan_pipeline",
    "tiny_wan_transformer",
    "tiny_wan_vae",
]


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


def tiny_tokenizer(vocabulary: list[str] | None = None, max_length: int = 512) -> "PreTrainedTokenizerFast":  # noqa: F821
    """A word-level tokenizer trained here on a few words (lower-cased, ``</s>`` appended)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    words = (
        vocabulary
        or (
            "a an the red green blue yellow white black circle square triangle moving left right up down "
            "cat dog bird fish flying running on in of with and video photo"
        ).split()
    )
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=max_length
    )


def tiny_text_encoder(vocab_size: int, seed: int = 0) -> "UMT5EncoderModel":  # noqa: F821
    """A 2-layer ``UMT5EncoderModel`` of width 32 (Wan's text encoder family), randomly initialised."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab_size,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()


#: The Wan models :func:`tiny_wan_pipeline` builds at toy width, by the name of the model they copy.
WAN_VARIANTS = ("wan2.1-t2v", "wan2.1-i2v", "wan2.2-ti2v", "wan2.2-a14b-t2v", "wan2.2-a14b-i2v")


def tiny_wan_vae(version: str = "2.1", seed: int = 0) -> "AutoencoderKLWan":  # noqa: F821
    """An ``AutoencoderKLWan`` with the options of a real Wan VAE at toy width (a few thousand parameters).

    * ``"2.1"`` (Wan2.1, and Wan2.2-A14B): ``z_dim`` 16, x8 spatial / x4 temporal compression.
    * ``"2.2"`` (Wan2.2-TI2V-5B): ``z_dim`` 48, ``is_residual``, a 2x2 pixel patch before the encoder
      (``patch_size`` 2, so 12 input / output channels) and x8 in the network: ``scale_factor_spatial`` 16,
      ``scale_factor_temporal`` 4. Its latent statistics are 0 / 1 (the real VAE's are trained values).
    """
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    common = dict(dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    if version == "2.1":
        return AutoencoderKLWan(base_dim=3, z_dim=16, **common).eval()
    if version == "2.2":
        return AutoencoderKLWan(
            base_dim=4,
            decoder_base_dim=6,
            z_dim=48,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=[0.0] * 48,
            latents_std=[1.0] * 48,
            **common,
        ).eval()
    raise ValueError(f"unknown Wan VAE version {version!r}: expected '2.1' or '2.2'")


def tiny_clip_vision(seed: int = 0) -> tuple["CLIPVisionModel", "CLIPImageProcessor"]:  # noqa: F821
    """Wan2.1 image-to-video's image encoder at toy size: a 2-layer ``CLIPVisionModel`` of width 16 on 32x32
    images (patch 8: 16 + 1 image tokens; the real one is CLIP ViT-H/14 at 224 px, width 1280, 257 tokens) and
    its ``CLIPImageProcessor`` (resize and centre-crop to 32)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            projection_dim=16,
        )
    ).eval()
    return encoder, CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def tiny_wan_pipeline(num_layers: int = 2, seed: int = 0, variant: str = "wan2.1-t2v") -> "DiffusionPipeline":  # noqa: F821
    """A complete Diffusers Wan pipeline at toy size: tokenizer, UMT5 encoder, Wan VAE, transformer(s), UniPC.

    ``variant`` (one of :data:`WAN_VARIANTS`) picks the pipeline class and the options of the real model:

    * ``"wan2.1-t2v"``: ``WanPipeline`` (Wan2.1-T2V-1.3B / 14B).
    * ``"wan2.1-i2v"``: ``WanImageToVideoPipeline`` with a CLIP image encoder (:func:`tiny_clip_vision`); the
      transformer takes 36 input channels (16 noisy latent + 4 mask + 16 image latent) and has
      ``image_dim`` (the CLIP width) and ``added_kv_proj_dim`` (its own width): image keys / values in every
      cross-attention (Wan2.1-I2V-14B).
    * ``"wan2.2-ti2v"``: ``WanPipeline`` with ``expand_timesteps=True``, the Wan2.2 VAE (``tiny_wan_vae("2.2")``,
      x16 spatial) and a 48-channel transformer (Wan2.2-TI2V-5B; load the same folder with
      ``WanImageToVideoPipeline`` for image-to-video, as with the real model).
    * ``"wan2.2-a14b-t2v"`` / ``"wan2.2-a14b-i2v"``: two transformers, ``transformer`` (high noise) and
      ``transformer_2`` (seed + 1), ``boundary_ratio`` 0.875 / 0.9; the I2V one is a ``WanImageToVideoPipeline``
      without image encoder (36 input channels, image latents only).

    Size rules: ``VideoGeometry.from_pipeline(pipe)`` (:mod:`mhla_diffusion.utils.geometry`), with a RoPE table of
    32 positions per axis. Every variant samples in well under a second on a CPU (e.g. 9x32x32, 2 steps;
    TI2V needs multiples of 32 px).
    """
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    if variant not in WAN_VARIANTS:
        raise ValueError(f"unknown Wan variant {variant!r}: choose one of {', '.join(WAN_VARIANTS)}")
    tokenizer = tiny_tokenizer()
    components = dict(
        tokenizer=tokenizer,
        text_encoder=tiny_text_encoder(len(tokenizer), seed=seed),
        vae=tiny_wan_vae("2.2" if variant == "wan2.2-ti2v" else "2.1", seed=seed),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
        ),
    )
    image_to_video = variant in ("wan2.1-i2v", "wan2.2-a14b-i2v")  # TI2V-5B's folder is a WanPipeline
    channels = dict(in_channels=36, out_channels=16) if image_to_video else {}
    if variant == "wan2.1-i2v":
        encoder, processor = tiny_clip_vision(seed)
        channels.update(image_dim=encoder.config.hidden_size, added_kv_proj_dim=24)  # 24: 2 heads x 12
        components.update(image_encoder=encoder, image_processor=processor)
    if variant == "wan2.2-ti2v":
        channels = dict(in_channels=48, out_channels=48)
        components.update(expand_timesteps=True)
    components["transformer"] = tiny_wan_transformer(num_layers=num_layers, seed=seed, **channels)
    if variant.startswith("wan2.2-a14b"):
        components["transformer_2"] = tiny_wan_transformer(num_layers=num_layers, seed=seed + 1, **channels)
        components["boundary_ratio"] = 0.9 if image_to_video else 0.875
    return (WanImageToVideoPipeline if image_to_video else WanPipeline)(**components)


#: A few ImageNet-style labels for the tiny DiT pipeline (ids 0..4); synonyms split on ",".
TINY_ID2LABEL = {0: "tench, Tinca tinca", 1: "goldfish", 2: "great white shark", 3: "tiger shark", 4: "hammerhead"}


def tiny_dit_pipeline(num_layers: int = 2, seed: int = 0) -> "DiTPipeline":  # noqa: F821
    """A complete Diffusers ``DiTPipeline`` at toy size (16x16 images: 8x8 latent, VAE x2)."""
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    ).eval()
    scheduler = DDIMScheduler(
        num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02, clip_sample=False
    )
    transformer = tiny_dit_transformer(num_layers=num_layers, seed=seed)
    return DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler, id2label=TINY_ID2LABEL)
