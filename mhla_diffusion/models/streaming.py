"""Running a block-causal MHLA Wan transformer as a stream: chunk after chunk, in constant memory.

A transformer converted with ``MHLAConfig(causal=True)`` attends forwards in time
(:mod:`mhla_diffusion.ops.causal`). Every layer outside self-attention works token by token (patch embedding
over one latent frame, norms, cross-attention, FFN, output head), so a chunk of latent frames can run on its
own, given what each causal MHLA layer carries from the chunks before it: ``K + 1`` temporal rows of block
summaries (:class:`~mhla_diffusion.ops.causal.CausalMHLAState`). :class:`CausalStream` holds those states::

    stream = CausalStream(transformer)
    for chunk in range(num_chunks):
        for t in timesteps:                       # denoise the chunk against the carried state
            with stream.chunk():
                noise_pred = transformer(noisy, t, text).sample
        with stream.chunk(advance=True):          # the finished (clean) chunk joins the state
            transformer(clean, zeros, text)

A stream gives exactly what one causal pass over the whole clip gives when the earlier chunks are clean
(timestep 0) and the current one noisy: the same as per-token timesteps ``(B, N)`` in one pass.

Positions. Wan's rotary table holds ``rope_max_seq_len`` positions per axis, and a stream goes past it. RoPE
enters MHLA only through products of rotated queries and keys, so any positions with the right differences
would do; here every latent frame keeps its absolute index (``origin`` of the chunk plus its local index), and
:class:`WanFramePositions` computes the rotary tables of the time axis from Wan's formula for any index instead
of reading them from the table (identical where the table has them). Summaries carried in the state were
rotated at their frames' absolute positions, so queries and cached keys stay consistent at any length.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from ..ops.causal import CausalMHLAState, check_state_dtype

__all__ = ["CausalStream", "ChunkStream", "WanFramePositions", "causal_processors", "install_frame_positions"]


class WanFramePositions(nn.Module):
    """Wan's 3-D rotary tables with the frames at positions ``origin, origin + 1, ...``, for any number of frames.

    Wraps Diffusers' ``WanRotaryPosEmbed`` (kept as ``self.rope``; it has no saved tensors, so state dicts do not
    change). Heights and widths read the table as before; the time axis is computed from Wan's formula
    (``theta`` 10000, float64 angles) whenever the frames are not the table's first rows.
    """

    def __init__(self, rope: nn.Module, theta: float = 10000.0) -> None:
        super().__init__()
        self.rope = rope
        self.theta = theta
        self.origin = 0
        #: The position of every frame, overriding ``origin`` (teacher forcing: two copies of a clip, alike).
        self.frame_positions: np.ndarray | None = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents ``(B, C, F, H, W)`` -> ``(cos, sin)``, each ``(1, F' * H' * W', 1, D)`` on the patched grid."""
        rope = self.rope
        p_t, p_h, p_w = rope.patch_size
        frames, height, width = (s // p for s, p in zip(hidden_states.shape[2:], (p_t, p_h, p_w)))
        if self.origin == 0 and self.frame_positions is None and frames <= rope.max_seq_len:
            return rope(hidden_states)
        from diffusers.models.embeddings import get_1d_rotary_pos_embed

        positions = np.arange(self.origin, self.origin + frames, dtype=np.float64)
        if self.frame_positions is not None:
            if len(self.frame_positions) != frames:
                raise ValueError(f"{len(self.frame_positions)} frame positions for {frames} latent frames")
            positions = np.asarray(self.frame_positions, dtype=np.float64)
        time_cos, time_sin = get_1d_rotary_pos_embed(
            rope.t_dim, positions, self.theta, use_real=True, repeat_interleave_real=True, freqs_dtype=torch.float64
        )
        sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
        tables = []
        for time, table in ((time_cos, rope.freqs_cos), (time_sin, rope.freqs_sin)):
            _, by_height, by_width = table.split(sizes, dim=1)
            grid = (frames, height, width)
            parts = [
                time.to(table).view(frames, 1, 1, -1).expand(*grid, -1),
                by_height[:height].view(1, height, 1, -1).expand(*grid, -1),
                by_width[:width].view(1, 1, width, -1).expand(*grid, -1),
            ]
            tables.append(torch.cat(parts, dim=-1).reshape(1, frames * height * width, 1, -1))
        return tables[0], tables[1]


def install_frame_positions(transformer: nn.Module) -> WanFramePositions:
    """Give a Wan ``transformer`` frame positions past its rotary table (idempotent); returns the wrapper."""
    rope = transformer.rope
    if not isinstance(rope, WanFramePositions):
        rope = transformer.rope = WanFramePositions(rope)
    return rope


def causal_processors(transformer: nn.Module) -> list[nn.Module]:
    """The block-causal MHLA processors of ``transformer``, in layer order."""
    found = []
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, nn.Module) and getattr(processor, "causal", False):
            found.append(processor)
    return found


class ChunkStream:
    """What a Wan ``transformer``'s self-attention layers carry from one chunk of latent frames to the next.

    The chunk mechanics shared by every kind of stream: inside :meth:`chunk` each of ``processors`` (whose
    ``stream`` attribute points here while the chunk runs) reads its carried state with :meth:`state` and hands
    its state after the chunk to :meth:`stage`; with ``advance=True`` those states replace the carried ones and
    the stream's position moves past the chunk's frames. Frames keep absolute positions
    (:class:`WanFramePositions`). Subclasses choose the processors and say what a state weighs
    (:meth:`state_nbytes`). One stream per sequence of calls with the same batch size.
    """

    def __init__(self, transformer: nn.Module, processors: list) -> None:
        self.processors = processors
        self.transformer = transformer
        self.positions = install_frame_positions(transformer)
        self.frames = 0  # latent frames (token-grid frames) consumed: the next chunk's first position
        self.states: dict[int, Any] = {}
        self._staged: dict[int, Any] = {}
        self._chunk_frames = 0
        self.advancing = False

    def _record_frames(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self._chunk_frames = latents.shape[2] // module.config.patch_size[0]

    @contextmanager
    def chunk(self, advance: bool = False) -> Iterator["ChunkStream"]:
        """Run the transformer on the next chunk inside this block; ``advance``: the chunk joins the state."""
        if any(getattr(p, "stream", None) is not None for p in self.processors):
            raise RuntimeError("a chunk of this transformer is already running (chunks do not nest)")
        hook = self.transformer.register_forward_pre_hook(self._record_frames, with_kwargs=True)
        for processor in self.processors:
            processor.stream = self
        self.positions.origin, self.advancing, self._staged = self.frames, advance, {}
        try:
            yield self
        finally:
            hook.remove()
            for processor in self.processors:
                processor.stream = None
            self.positions.origin, self.advancing = 0, False
        if advance:
            if len(self._staged) != len(self.processors):
                raise RuntimeError("advance=True needs one forward of the transformer inside the chunk block")
            self.states, self._staged = self._staged, {}
            self.frames += self._chunk_frames

    def state(self, processor: Any) -> Any:
        """What ``processor``'s layer carries (``None`` before the first chunk)."""
        return self.states.get(id(processor))

    def stage(self, processor: Any, state: Any) -> None:
        """Record ``processor``'s state after the running chunk (kept only when the chunk advances the stream)."""
        if self.advancing:
            self._staged[id(processor)] = state

    @staticmethod
    def state_nbytes(state: Any) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's carried state."""
        return sum(self.state_nbytes(state) for state in self.states.values())


class CausalStream(ChunkStream):
    """The state a block-causal MHLA Wan ``transformer`` carries from chunk to chunk (see the module docstring).

    Inside :meth:`chunk` every causal MHLA layer runs :func:`~mhla_diffusion.ops.causal.mhla_causal_step` on the
    chunk against its carried :class:`~mhla_diffusion.ops.causal.CausalMHLAState` (``K + 1`` temporal rows of
    block summaries): the same size after any number of chunks (:attr:`nbytes`). A denoising chunk only reads the
    states; an advancing one builds the next.

    ``state_dtype``: the dtype the block summaries are stored in (``None``: float32, exact; ``torch.bfloat16``: half
    the bytes, see docs/streaming.md for the error); they are always mixed in float32 or wider.
    """

    def __init__(self, transformer: nn.Module, state_dtype: torch.dtype | None = None) -> None:
        check_state_dtype(state_dtype)  # before any chunk runs
        self.state_dtype = state_dtype
        processors = causal_processors(transformer)
        if not processors:
            raise ValueError(
                "this transformer has no block-causal MHLA layer, so it cannot stream: convert it with "
                "MHLAConfig(causal=True) (and fine-tune it so), or generate the whole clip in one pass"
            )
        super().__init__(transformer, processors)

    @staticmethod
    def state_nbytes(state: CausalMHLAState) -> int:
        return state.nbytes
