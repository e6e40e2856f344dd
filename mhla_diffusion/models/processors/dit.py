"""MHLA self-attention processor for Diffusers' ``DiTTransformer2DModel`` (``transformer_blocks.{i}.attn1``)."""

from __future__ import annotations

import torch

from .base import MHLAProcessor

__all__ = ["DiTMHLAProcessor"]


class DiTMHLAProcessor(MHLAProcessor):
    """Replaces softmax self-attention of one DiT ``Attention`` layer by MHLA.

    Reuses the layer's ``to_q/to_k/to_v/to_out`` (and ``norm_q/norm_k`` if the model has them);
    features ``ReLU(x) + eps``; paper denominator by default; optional 3x3 LePE (identity init) and
    gate. Token grid (rows, columns) from the transformer's pre-hook.

    With :meth:`MHLAConfig.released_dit` it computes the released ``MHLA4DiT`` attention:
    ``to_out(MHLA(LN(x)) + LePE(v)) -> dropout``, where ``LN`` is ``input_norm``, the projections
    read ``LN(x)``, and MHLA divides by the scalar-mixed denominator.
    """

    num_axes = 2
    lepe_identity_init = True

    # Diffusers' ``Attention.forward`` filters keyword arguments by this signature, so it must be
    # spelled out rather than inherited from ``nn.Module.__call__(*args, **kwargs)``.
    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb)

    def forward(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` ``(B, N, C)`` -> ``(B, N, C)``."""
        if encoder_hidden_states is not None:
            raise ValueError("DiTMHLAProcessor is for self-attention only; got `encoder_hidden_states`")
        if attention_mask is not None:
            raise ValueError("DiTMHLAProcessor does not support `attention_mask`: MHLA attends over every token")
        if hidden_states.ndim != 3:
            raise ValueError(f"DiTMHLAProcessor expects (B, N, C) hidden states, got {tuple(hidden_states.shape)}")
        residual = hidden_states
        hidden_states = self.normalize_input(hidden_states)
        heads = (attn.heads, -1)
        query = attn.to_q(hidden_states).unflatten(2, heads)
        key = attn.to_k(hidden_states).unflatten(2, heads)
        value = attn.to_v(hidden_states).unflatten(2, heads)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        out = self.attend(hidden_states, query, key, value)
        out = self.drop_output(attn.to_out[1](attn.to_out[0](out.type_as(hidden_states))))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor
