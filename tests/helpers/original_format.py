"""Tiny released-format (original Wan) checkpoints: a Diffusers model's state dict under the original names."""

from __future__ import annotations

import re

import torch

from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.tiny import tiny_wan_transformer

# Diffusers -> original Wan names, written out independently of the importer's rules.
TO_ORIGINAL = [
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


def to_original(model) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        for pattern, repl in TO_ORIGINAL:
            key = re.sub(pattern, repl, key)
        if key.endswith("block_attn.conv.weight"):
            value = value[:, :, None, None]
        out[key] = value.clone()
    return out


def released_model(gate: bool, lepe: bool = False):
    model = tiny_wan_transformer(num_layers=3)
    convert_to_mhla(model, MHLAConfig.released_wan(gate=gate, layers="hybrid", layout=(2, 2, 3), lepe=lepe))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model
