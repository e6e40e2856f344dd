"""MHLA joint attention processor for Diffusers' ``FluxTransformer2DModel``.

Flux attends over ``[text, image]``: its double-stream blocks (``transformer_blocks.{i}.attn``) project each stream
with its own weights and return both; its single-stream blocks (``single_transformer_blocks.{i}.attn``) get the
concatenated sequence and return it. RoPE covers the joint sequence, with text ids 0 (no rotation). MHLA cuts the
image tokens into blocks on the grid of ``img_ids`` and gives the text its own block (:mod:`~mhla_diffusion.ops.joint`).
"""

from __future__ import annotations

import torch

from .base import MHLAProcessor, joint_projections, rotary_rows

__all__ = ["FluxMHLAProcessor"]


class FluxMHLAProcessor(MHLAProcessor):
    """Replaces the joint softmax attention of one Flux double- or single-stream block by joint MHLA."""

    num_axes = 2
    text_block = True

    def forward(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Double-stream: image ``(B, N, C)`` and text ``(B, L, C)`` -> (image, text). Single-stream: the joint
        ``[text, image]`` ``(B, L + N, C)`` -> the same shape."""
        if attention_mask is not None:
            raise ValueError("FluxMHLAProcessor takes no attention mask (Flux's blocks pass none)")
        double = encoder_hidden_states is not None
        if double:
            image_in, text_in = hidden_states, encoder_hidden_states
        else:  # the text tokens come first; the grid says how many image tokens follow
            length = hidden_states.shape[1] - self.grid_context.require_total()
            text_in, image_in = hidden_states[:, :length], hidden_states[:, length:]
        q, k, v = joint_projections(attn, image_in)
        text_q, text_k, text_v = joint_projections(attn, text_in, added=double)
        length = text_in.shape[1]  # the text rows of the RoPE tables are identities (txt_ids zero: grid.py checks)
        image, text = self.attend_joint(
            q, k, v, text_q, text_k, text_v, rotary_emb=rotary_rows(image_rotary_emb, slice(length, None))
        )
        image, text = image.to(q.dtype), text.to(q.dtype)
        if not double:
            return torch.cat([text, image], dim=1)
        image = self.drop_output(attn.to_out[1](attn.to_out[0](image.contiguous())))
        return image, attn.to_add_out(text.contiguous())
