"""Tiny Wan and DiT transformers built from configs (no downloads), for demos and tests.

They have the real architectures at toy width, so conversion, save/load and the processors run
exactly as on Wan2.1-1.3B or DiT-XL/2, in milliseconds on a CPU.
"""

from __future__ import annotations

import torch

__all__ = [
    "TINY_ID2LABEL",
    "tiny_dit_pipeline",
    "tiny_dit_transformer",
    "tiny_text_encoder",
    "tiny_tokenizer",
    "tiny_wan_pipeline",
    "tiny_wan_transformer",
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

    words = vocabulary or (
        "a an the red green blue yellow white black circle square triangle moving left right up down "
        "cat dog bird fish flying running on in of with and video photo"
    ).split()
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
            vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
    ).eval()


def tiny_wan_pipeline(num_layers: int = 2, seed: int = 0) -> "WanPipeline":  # noqa: F821
    """A complete Diffusers ``WanPipeline`` at toy size: tokenizer, UMT5 encoder, Wan VAE, transformer, UniPC.

    Its size rules are Wan2.1's (``VideoGeometry.from_pipeline(pipe)``, :mod:`mhla_diffusion.geometry`), with
    a RoPE table of 32 positions per axis.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    tokenizer = tiny_tokenizer()
    text_encoder = tiny_text_encoder(len(tokenizer), seed=seed)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    transformer = tiny_wan_transformer(num_layers=num_layers, seed=seed)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)


#: A few ImageNet-style labels for the tiny DiT pipeline (ids 0..4); synonyms split on ",".
TINY_ID2LABEL = {0: "tench, Tinca tinca", 1: "goldfish", 2: "great white shark", 3: "tiger shark", 4: "hammerhead"}


def tiny_dit_pipeline(num_layers: int = 2, seed: int = 0) -> "DiTPipeline":  # noqa: F821
    """A complete Diffusers ``DiTPipeline`` at toy size (16x16 images: 8x8 latent, VAE x2)."""
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
    ).eval()
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02, clip_sample=False)
    transformer = tiny_dit_transformer(num_layers=num_layers, seed=seed)
    return DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler, id2label=TINY_ID2LABEL)
