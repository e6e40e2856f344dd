"""Teacher forcing of a block-causal MHLA Wan transformer: every chunk of a clip trained as a stream denoises it.

A stream (:class:`~mhla_diffusion.models.streaming.CausalStream`) denoises chunk ``c`` against the clean chunks
before it. :class:`TeacherForcing` gives one forward of the transformer the same view of a whole clip: its input is
the clip twice along the frame axis, ``[clean | noisy]`` (``(B, C, 2F, H, W)``, per-token timesteps ``(B, 2N)``:
the clean copy at 0 or a context level, each noisy chunk at its own level), and inside the block every causal MHLA
layer runs

* on the clean copy, one block-causal pass (:func:`~mhla_diffusion.ops.causal.mhla_causal_attention`): what the
  stream's advance forwards compute, chunk after chunk;
* on the noisy copy, :func:`~mhla_diffusion.ops.teacher_forcing.mhla_causal_teacher_forcing`: each chunk against
  the clean copy's earlier chunks and its own rows, one ``(M, 2M)`` mixing of both copies' block summaries.

A block-causal softmax transformer (:func:`~mhla_diffusion.models.kv_cache.use_kv_cache` with ``block_causal=True``,
the streaming teacher) runs the same view as one softmax attention over the ``2N`` tokens with a block mask
(:func:`~mhla_diffusion.models.kv_cache.teacher_forcing_mask`).

Both copies keep the same frame positions (the noisy copy's frame ``f`` is at position ``f``, as the clean one's),
through :class:`~mhla_diffusion.models.streaming.WanFramePositions`, so a clip may run past the rotary table as a
stream does. Every other layer works token by token. The noisy half of the output is therefore, chunk by chunk,
the stream's denoising output (``tests/streaming/test_causal_stream.py`` checks it in float64)::

    with TeacherForcing(transformer, chunk_frames=[1, 4, 4]):
        out = transformer(torch.cat([clean, noisy], dim=2), timesteps_per_token, text).sample[:, :, frames:]
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from .streaming import causal_processors, install_frame_positions

__all__ = ["TeacherForcing"]


class TeacherForcing:
    """Context manager: inside it, ``transformer`` (block-causal MHLA or softmax Wan) takes ``[clean | noisy]`` along
    the frame axis and trains the noisy copy as a stream denoises it (see the module docstring).

    ``chunk_frames``: the clip's chunks in latent frames (token-grid frames: latent frames over the temporal patch),
    e.g. ``[1, 4, 4]`` for a first chunk of its own length; they add up to the clip's frames ``F`` (half the input's).
    """

    def __init__(self, transformer: nn.Module, chunk_frames: Sequence[int]) -> None:
        from .kv_cache import kv_cache_processors

        self.processors = causal_processors(transformer)
        self.processors += [p for p in kv_cache_processors(transformer) if p.block_causal]
        if not self.processors:
            raise ValueError(
                "teacher forcing trains block-causal layers and this transformer has none: convert it with "
                "MHLAConfig(causal=True), or use_kv_cache(transformer, block_causal=True) for softmax, first"
            )
        if not chunk_frames or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in chunk_frames):
            raise ValueError(f"`chunk_frames` must be positive numbers of latent frames, got {list(chunk_frames)!r}")
        self.transformer = transformer
        self.chunk_rows = [int(c) for c in chunk_frames]  # one temporal block row per latent frame in a causal layer
        self.frames = sum(self.chunk_rows)
        self._hook: Any = None
        self._masks: dict[tuple, torch.Tensor] = {}

    def softmax_mask(self, tokens_per_frame: int, device: torch.device) -> torch.Tensor:
        """The block mask of the softmax layers (:func:`~mhla_diffusion.models.kv_cache.teacher_forcing_mask`),
        built once for every layer of the forward."""
        from .kv_cache import teacher_forcing_mask

        key = (tokens_per_frame, torch.device(device))
        if key not in self._masks:
            self._masks[key] = teacher_forcing_mask(self.chunk_rows, tokens_per_frame, device)
        return self._masks[key]

    def _check_input(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        frames = latents.shape[2] // module.config.patch_size[0]
        if frames != 2 * self.frames:
            raise ValueError(
                f"teacher forcing takes the clip twice, [clean | noisy] along the frame axis: {2 * self.frames} "
                f"latent frames for chunks {self.chunk_rows}, got {frames}"
            )

    def __enter__(self) -> "TeacherForcing":
        if any(getattr(p, "stream", None) is not None or getattr(p, "forcing", None) for p in self.processors):
            raise RuntimeError("a stream or another teacher forcing of this transformer is running (they do not nest)")
        positions = install_frame_positions(self.transformer)
        positions.frame_positions = np.tile(np.arange(self.frames, dtype=np.float64), 2)  # both copies alike
        self._hook = self.transformer.register_forward_pre_hook(self._check_input, with_kwargs=True)
        for processor in self.processors:
            processor.forcing = self
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hook.remove()
        self.transformer.rope.frame_positions = None
        for processor in self.processors:
            processor.forcing = None
