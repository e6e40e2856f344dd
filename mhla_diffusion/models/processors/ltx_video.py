"""MHLA self-attention processor for Diffusers' ``LTXVideoTransformer3DModel`` (``transformer_blocks.{i}.attn1``).

LTX-Video normalises q and k across the whole inner dim and rotates them there, before the head split, with a
table that differs per head. MHLA applies LTX's own rotation to the features ``ReLU(x) + eps`` (the numerator's
RoPE) and passes them to the operator with the un-rotated features for the denominator. Its grid comes from the
forward's ``num_frames``, ``height``, ``width``; cross-attention (``attn2``) keeps its processor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MHLAProcessor

__all__ = ["LTXVideoMHLAProcessor"]


class LTXVideoMHLAProcessor(MHLAProcessor):
    """Replaces softmax self-attention of one ``LTXAttention`` layer by MHLA."""

    num_axes = 3

    def forward(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` ``(B, N, C)`` -> ``(B, N, C)``."""
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("LTXVideoMHLAProcessor is for self-attention (attn1), which takes no text and no mask")
        hidden_states = self.normalize_input(hidden_states)
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        q, k = F.relu(query) + self.eps, F.relu(key) + self.eps
        q_rot = k_rot = None
        if image_rotary_emb is not None:
            q_rot, k_rot = apply_rotary_emb(q, image_rotary_emb), apply_rotary_emb(k, image_rotary_emb)
        heads = lambda x: None if x is None else x.unflatten(2, (attn.heads, -1))  # noqa: E731
        out = self.attend_features(hidden_states, heads(q), heads(k), heads(value), heads(q_rot), heads(k_rot))
        out = attn.to_out[0](out.to(hidden_states.dtype))
        return self.drop_output(attn.to_out[1](out))
