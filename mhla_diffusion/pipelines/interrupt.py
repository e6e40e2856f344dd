"""How a generation that is stopped early ends, said the same way by every entry point.

A stream (:class:`~mhla_diffusion.pipelines.wan_streaming.MHLAWanStreamingPipeline`) hands each chunk's frames on
as soon as they are decoded, so a stop never loses them. Ctrl-C during a pipeline call raises
:class:`GenerationInterrupted`, which carries what was delivered; ``mhla text-to-video`` prints its one line and
completes the settings JSON beside the kept video; the web demo's *Stop* ends the video after the current chunk
and says the same (:func:`kept_line`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GenerationInterrupted", "kept_line"]


def kept_line(frames_kept: int, num_frames: int, chunks_done: int, num_chunks: int) -> str:
    """``"kept 45 of 321 frames (5 of 40 chunks)"``: what a stopped stream delivered."""
    return f"kept {frames_kept} of {num_frames} frames ({chunks_done} of {num_chunks} chunks)"


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C (``KeyboardInterrupt``) during a streamed generation, with what was delivered before it.

    A ``KeyboardInterrupt``, so no ``except Exception`` on the way up swallows it. ``frames_kept``: video frames
    handed to ``on_frames`` (every finished chunk's); ``frames``: those frames as the call would have returned them
    (``None`` with ``return_frames=False``, or when no chunk finished).
    """

    def __init__(
        self, frames_kept: int, num_frames: int, chunks_done: int, num_chunks: int, frames: Any = None
    ) -> None:
        self.frames_kept, self.num_frames = frames_kept, num_frames
        self.chunks_done, self.num_chunks = chunks_done, num_chunks
        self.frames = frames
        super().__init__(f"interrupted: {kept_line(frames_kept, num_frames, chunks_done, num_chunks)}")

    @property
    def exit_code(self) -> int:
        """What a command line exits with: 130, as a shell does after Ctrl-C (128 + SIGINT)."""
        return 130
