"""Wan prompt embeddings, computed exactly as ``WanPipeline`` does at inference.

``WanPipeline._get_t5_prompt_embeds`` cleans the prompt, tokenizes to ``max_sequence_length``, runs
the encoder with the attention mask, keeps each prompt's real tokens and zero-pads the rest. Here the
unpadded ``(L_i, D)`` embeddings are returned (what the cache stores) and padding is a separate
step, so training sees the same tensors the pipeline feeds the transformer.
"""

from __future__ import annotations

from typing import Sequence

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from torch import nn

__all__ = ["encode_prompts", "pad_prompt_embeds"]


@torch.no_grad()
def encode_prompts(
    tokenizer, text_encoder: nn.Module, prompts: Sequence[str], max_sequence_length: int
) -> list[torch.Tensor]:
    """Unpadded embeddings ``(L_i, D)`` of each prompt (``L_i`` = its tokens, at most ``max_sequence_length``)."""
    cleaned = [prompt_clean(p) for p in prompts]
    tokens = tokenizer(
        cleaned,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    device = next(text_encoder.parameters()).device
    mask = tokens.attention_mask.to(device)
    hidden = text_encoder(tokens.input_ids.to(device), mask).last_hidden_state
    lengths = mask.gt(0).sum(dim=1).tolist()
    return [h[:n] for h, n in zip(hidden, lengths)]


def pad_prompt_embeds(embeds: Sequence[torch.Tensor], max_sequence_length: int) -> torch.Tensor:
    """Zero-pad ``(L_i, D)`` embeddings to ``(B, max_sequence_length, D)``."""
    first = embeds[0]
    out = first.new_zeros(len(embeds), max_sequence_length, first.shape[-1])
    for row, embed in enumerate(embeds):
        out[row, : embed.shape[0]] = embed[:max_sequence_length]
    return out
