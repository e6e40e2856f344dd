"""MHLA self-attention processor for Diffusers' ``SkyReelsV2Transformer3DModel`` (``blocks.{i}.attn1``).

SkyReels-V2's attention is Wan's (projections, RMSNorm across heads, 3-D RoPE), so the Wan processor serves it. Its
diffusion-forcing models with ``num_frame_per_block > 1`` pass a dense block-causal ``N x N`` mask: a token sees
every token of its own block of frames and of earlier blocks. Block-causal MHLA (``MHLAConfig(causal=True)``) is
that attention pattern in linear form, with one temporal block row per block of frames; the processor reads the
frames per block from the mask's first row and never multiplies by the mask.
"""

from __future__ import annotations

import torch

from .wan import WanMHLAProcessor, wan_qkv

__all__ = ["SkyReelsV2MHLAProcessor"]


class SkyReelsV2MHLAProcessor(WanMHLAProcessor):
    """Replaces softmax self-attention of one ``SkyReelsV2Attention`` layer by MHLA (block-causal when converted
    with ``causal=True``, as its diffusion-forcing mask asks)."""

    #: Latent frames per temporal block row of a causal layer, read from the call's mask (1 without one).
    frames_per_row: int = 1

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
            raise ValueError("SkyReelsV2MHLAProcessor is for self-attention (attn1); attn2 keeps its own processor")
        self.frames_per_row = 1 if attention_mask is None else self._frames_per_block(attention_mask, hidden_states)
        hidden_states = self.normalize_input(hidden_states)
        out = self.attend(hidden_states, *wan_qkv(attn, hidden_states), rotary_emb)
        out = attn.to_out[0](out.type_as(hidden_states))
        return self.drop_output(attn.to_out[1](out))

    def _frames_per_block(self, mask: torch.Tensor, hidden_states: torch.Tensor) -> int:
        """The frames per causal block of SkyReels-V2's block-causal mask ``(1, 1, N, N)``: its first query sees the
        first block's tokens."""
        if not self.causal:
            raise ValueError(
                "this SkyReels-V2 model runs block-causal attention (num_frame_per_block > 1, a causal mask): "
                "MHLA replaces the mask only in block-causal form; convert with MHLAConfig(causal=True)"
            )
        grid = self.grid_context.require(hidden_states.shape[1])
        per_frame = grid[1] * grid[2]
        seen = int(mask.reshape(-1, mask.shape[-1])[0].sum().item())
        if mask.dtype != torch.bool or seen % per_frame or grid[0] % (seen // per_frame):
            raise ValueError(
                f"expected SkyReels-V2's boolean block-causal mask over whole blocks of frames (grid {grid}); got a "
                f"{mask.dtype} mask whose first query sees {seen} tokens"
            )
        return seen // per_frame

    def causal_layout(self, grid: tuple[int, ...]) -> tuple[int, ...]:
        """One temporal block row per block of :attr:`frames_per_row` frames."""
        return (grid[0] // self.frames_per_row, *self.layout[1:])
