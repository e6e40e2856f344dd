"""MHLA self-attention processor for Diffusers' ``WanTransformer3DModel`` (``blocks.{i}.attn1``)."""

from __future__ import annotations

import torch

from .base import MHLAProcessor

__all__ = ["WanMHLAProcessor", "wan_qkv"]


def wan_qkv(attn: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``WanAttention`` layer's projections of ``hidden_states`` ``(B, N, C)``: ``q, k, v`` ``(B, N, H, D)``, with
    its fused or separate ``to_q/to_k/to_v`` and its ``norm_q/norm_k`` (RMSNorm across heads), before RoPE."""
    if getattr(attn, "fused_projections", False):
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    query, key = attn.norm_q(query), attn.norm_k(key)
    heads = (attn.heads, -1)
    return query.unflatten(2, heads), key.unflatten(2, heads), value.unflatten(2, heads)


class WanMHLAProcessor(MHLAProcessor):
    """Replaces softmax self-attention of one ``WanAttention`` layer by MHLA.

    Reuses the layer's ``to_q/to_k/to_v/to_out`` and its ``norm_q/norm_k`` (RMSNorm across heads);
    features ``ReLU(x) + eps``; Wan's 3-D RoPE after the feature map; token grid (frames, height,
    width) from the transformer's pre-hook. Cross-attention (``attn2``) keeps its own processor.
    """

    num_axes = 3
    causal_support = True

    def forward(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` ``(B, N, C)`` -> ``(B, N, C)``."""
        if encoder_hidden_states is not None:
            raise ValueError("WanMHLAProcessor is for self-attention (attn1); cross-attention keeps WanAttnProcessor")
        if attention_mask is not None:
            raise ValueError("WanMHLAProcessor does not support `attention_mask`: MHLA attends over every token")
        hidden_states = self.normalize_input(hidden_states)  # identity unless `input_norm`
        out = self.attend(hidden_states, *wan_qkv(attn, hidden_states), rotary_emb)
        out = attn.to_out[0](out.type_as(hidden_states))
        return self.drop_output(attn.to_out[1](out))
