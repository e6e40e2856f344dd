"""Tiny released-format (original Wan) checkpoints: a Diffusers model's state dict under the original names."""

from __future__ import annotations

import re

import torch

from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.models.tiny import tiny_wan_transformer

# Diffusers -> original Wan names, written out independently of the importer's rules.
TO_ORIGINAL = [
    # image-to-video: before the generic `.norm2.` and `.attn2.norm_` rules below would rename parts of these
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^condition_embedder\.image_embedder\.pos_embed$", "img_emb.emb_pos"),
    (r"\.attn2\.add_(k|v)_proj\.", r".cross_attn.\1_img."),
    (r"\.attn2\.norm_added_k\.", ".cross_attn.norm_k_img."),
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^proj_out\.", "head.head."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"\.scale_shift_table$", ".modulation"),
    (r"\.attn1\.processor\.mixing$", ".self_attn.block_attn.conv.weight"),
    (r"\.attn1\.processor\.out_norm\.", ".self_attn.g_norm."),
    (r"\.attn1\.processor\.gate\.", ".self_attn.g."),
    (r"\.attn1\.processor\.lepe\.", ".self_attn.lepe."),
    (r"\.attn1\.to_out\.0\.", ".self_attn.o."),
    (r"\.attn2\.to_out\.0\.", ".cross_attn.o."),
    (r"\.attn1\.to_(q|k|v)\.", r".self_attn.\1."),
    (r"\.attn2\.to_(q|k|v)\.", r".cross_attn.\1."),
    (r"\.attn1\.norm_", ".self_attn.norm_"),
    (r"\.attn2\.norm_", ".cross_attn.norm_"),
    (r"\.norm2\.", ".norm3."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
]


def original_key(key: str) -> str:
    """The original Wan name of a Diffusers ``WanTransformer3DModel`` (+ MHLA processor) key."""
    for pattern, repl in TO_ORIGINAL:
        key = re.sub(pattern, repl, key)
    return key


def to_original(model) -> dict[str, torch.Tensor]:
    """The model's state dict under the original names, as copies (meta tensors stay on the meta device)."""
    out = {}
    for key, value in model.state_dict().items():
        key = original_key(key)
        if key.endswith("block_attn.conv.weight"):
            value = value[:, :, None, None]
        out[key] = value.clone()
    return out


def released_model(gate: bool, lepe: bool = False, **model_options):
    """A tiny Wan (``model_options``: e.g. I2V's ``image_dim``) with released-setting MHLA on blocks 1, 2, perturbed."""
    model = tiny_wan_transformer(num_layers=3, **model_options)
    convert_to_mhla(model, MHLAConfig.released_wan(gate=gate, layers="hybrid", layout=(2, 2, 3), lepe=lepe))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def i2v_inputs(model, frames: int = 3, height: int = 4, width: int = 6, image_tokens: int = 4, seed: int = 0) -> dict:
    """Keyword inputs of a tiny image-to-video Wan ``model`` (its ``in_channels``, ``image_dim`` and, for
    FLF2V, the first and last frames' image tokens that its ``pos_embed`` expects)."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    images = 2 if config.pos_embed_seq_len else 1
    tokens = config.pos_embed_seq_len // 2 if config.pos_embed_seq_len else image_tokens
    return dict(
        hidden_states=torch.randn(1, config.in_channels, frames, 2 * height, 2 * width, generator=g),
        timestep=torch.full((1,), 500),
        encoder_hidden_states=torch.randn(1, 7, config.text_dim, generator=g),
        encoder_hidden_states_image=torch.randn(images, tokens, config.image_dim, generator=g),
    )


def outside(tensors: dict[str, torch.Tensor], path) -> list[str]:
    """Names of the tensors whose data does not lie in this process's memory mapping of ``path``."""
    from mhla_diffusion.benchmarks.load import in_weight_file_mapping

    names = sorted(tensors)
    return [
        name for name, inside in zip(names, in_weight_file_mapping((tensors[n] for n in names), [path])) if not inside
    ]
