"""MHLA joint attention processor for Diffusers' ``CogVideoXTransformer3DModel`` (``transformer_blocks.{i}.attn1``).

CogVideoX attends over ``[text, image]`` with one set of projections and per-head LayerNorms for both, RoPE on the
image tokens (CogVideoX 1.5 and 5B; 2B adds sin-cos position embeddings before the blocks instead), and no mask.
MHLA cuts the image tokens into blocks and gives the text its own block (:mod:`~mhla_diffusion.ops.joint`).
"""

from __future__ import annotations

import torch

from .base import MHLAProcessor, joint_projections, rotary_rows

__all__ = ["CogVideoXMHLAProcessor"]


class CogVideoXMHLAProcessor(MHLAProcessor):
    """Replaces the joint softmax attention of one CogVideoX block by joint MHLA."""

    num_axes = 3
    text_block = True

    # Diffusers' ``Attention.forward`` filters keyword arguments by this signature.
    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    def forward(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Image ``hidden_states`` ``(B, N, C)`` and text ``encoder_hidden_states`` ``(B, L, C)`` -> both, attended."""
        if encoder_hidden_states is None:
            raise ValueError("CogVideoXMHLAProcessor is joint attention: it needs the text (encoder_hidden_states)")
        if attention_mask is not None:
            raise ValueError("CogVideoXMHLAProcessor takes no attention mask (CogVideoX's blocks pass none)")
        q, k, v = joint_projections(attn, hidden_states)  # one set of projections for both streams
        image, text = self.attend_joint(
            q, k, v, *joint_projections(attn, encoder_hidden_states),
            rotary_emb=rotary_rows(image_rotary_emb, slice(None)),
        )  # fmt: skip
        out = torch.cat([text, image], dim=1).to(q.dtype)  # one output projection over [text, image], as stock
        out = self.drop_output(attn.to_out[1](attn.to_out[0](out)))
        length = encoder_hidden_states.shape[1]
        return out[:, length:], out[:, :length]
