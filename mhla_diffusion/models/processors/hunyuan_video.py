"""MHLA joint attention processor for Diffusers' ``HunyuanVideoTransformer3DModel``.

Its double-stream blocks (``transformer_blocks.{i}.attn``) project image and text tokens with their own weights,
its single-stream blocks (``single_transformer_blocks.{i}.attn``) with shared ones; both attend over
``[image, text]`` with a per-sample text mask and RoPE on the image tokens. MHLA cuts the image tokens into
blocks and gives the text its own block (:mod:`~mhla_diffusion.ops.joint`). The text encoder's token refiner keeps
its softmax attention.
"""

from __future__ import annotations

import torch

from .base import MHLAProcessor, joint_projections, rotary_rows

__all__ = ["HunyuanVideoMHLAProcessor", "text_mask_of"]


def text_mask_of(attention_mask: torch.Tensor | None, num_image: int, text_last: bool = True) -> torch.Tensor | None:
    """The text tokens' part ``(B, L)`` of a joint boolean key mask (``(B, 1, 1, N + L)``, ``True``: attend)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"joint MHLA takes a boolean attention mask (True: attend), got {attention_mask.dtype}")
    keys = attention_mask.reshape(attention_mask.shape[0], -1)
    return keys[:, num_image:] if text_last else keys[:, : keys.shape[1] - num_image]


class HunyuanVideoMHLAProcessor(MHLAProcessor):
    """Replaces the joint softmax attention of one HunyuanVideo double- or single-stream block by joint MHLA."""

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
            raise ValueError("HunyuanVideoMHLAProcessor is joint attention: it needs the text (encoder_hidden_states)")
        q, k, v = joint_projections(attn, hidden_states)
        # single-stream blocks have one set of projections for both streams
        text_q, text_k, text_v = joint_projections(attn, encoder_hidden_states, added=attn.add_q_proj is not None)
        image, text = self.attend_joint(
            q, k, v, text_q, text_k, text_v,
            text_mask_of(attention_mask, hidden_states.shape[1]),
            rotary_rows(image_rotary_emb, slice(None)),
        )  # fmt: skip
        image, text = image.to(q.dtype), text.to(q.dtype)
        if attn.to_out is not None:
            image = self.drop_output(attn.to_out[1](attn.to_out[0](image)))
        if attn.to_add_out is not None:
            text = attn.to_add_out(text)
        return image, text
