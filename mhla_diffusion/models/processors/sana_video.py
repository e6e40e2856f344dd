"""MHLA self-attention processor for Diffusers' ``SanaVideoTransformer3DModel`` (``transformer_blocks.{i}.attn1``).

SANA-Video's self-attention is already linear attention: ``φ = ReLU`` (no offset) after the q/k RMSNorm, Wan's
RoPE on the numerator only, the plain ``q · Σ k`` denominator. MHLA keeps that feature map and RoPE placement, so
with every mixing coefficient equal it computes the stock attention (global linear attention), and a converted model
starts where the stock one is; the block mixing is what it adds.
"""

from __future__ import annotations

import torch

from .base import MHLAProcessor

__all__ = ["SanaVideoMHLAProcessor"]


class SanaVideoMHLAProcessor(MHLAProcessor):
    """Replaces the ReLU linear self-attention of one SANA-Video ``Attention`` layer by MHLA."""

    num_axes = 3

    @property
    def feature_offset(self) -> float:
        """0: SANA-Video's own feature map, ``ReLU(x)``."""
        return 0.0

    # Diffusers' ``Attention.forward`` filters keyword arguments by this signature.
    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    def forward(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` ``(B, N, C)`` -> ``(B, N, C)``."""
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("SanaVideoMHLAProcessor is for self-attention (attn1), which takes no text and no mask")
        hidden_states = self.normalize_input(hidden_states)
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        heads = (attn.heads, -1)
        out = self.attend(hidden_states, query.unflatten(2, heads), key.unflatten(2, heads), value.unflatten(2, heads),
                          rotary_emb)  # fmt: skip
        out = attn.to_out[0](out.to(hidden_states.dtype))
        return self.drop_output(attn.to_out[1](out))
