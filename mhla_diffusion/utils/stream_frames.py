"""The chunk rule of streaming generation (``MHLAWanStreamingPipeline``, ``mhla text-to-video --stream``).

A stream denoises ``chunk_frames`` latent frames at a time. Wan's VAE maps ``1 + 4k`` video frames to ``1 + k``
latent frames (``4``: its temporal factor ``t``), so a video of ``n`` whole chunks has
``1 + t * (n * chunk_frames - 1)`` frames: the first chunk decodes to ``1 + t * (chunk_frames - 1)`` frames, every
later one to ``t * chunk_frames``. With chunks of 3 latent frames: 9, 21, 33, 45, ... frames.

Without a chunk size the stream takes the largest of :data:`DEFAULT_CHUNK_FRAMES` (3, 2, 1) that divides the
clip's latent frames, so every frame count the VAE can produce streams. Torch-free, so the command line checks
a frame count before anything loads; so is :data:`BLOCK_CAUSAL_KEY`, the mark of a streamable softmax model.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BLOCK_CAUSAL_KEY", "DEFAULT_CHUNK_FRAMES", "StreamChunks", "stream_chunks"]

#: The transformer config entry (its ``config.json``; Diffusers keeps ``_`` entries through save and load) that
#: records block-causal softmax self-attention over latent frames, ``"_mhla_block_causal": true``: such a model
#: streams with a KV cache (:mod:`mhla_diffusion.models.kv_cache`).
BLOCK_CAUSAL_KEY = "_mhla_block_causal"

#: Latent frames per chunk when none is asked for, in order of preference (3: CausVid's and Self-Forcing's chunk).
DEFAULT_CHUNK_FRAMES = (3, 2, 1)


@dataclass(frozen=True)
class StreamChunks:
    """How a streamed video is cut: ``num_chunks`` chunks of ``chunk_frames`` latent frames (``temporal``: the VAE's
    temporal factor)."""

    num_frames: int
    chunk_frames: int
    num_chunks: int
    temporal: int

    @property
    def latent_frames(self) -> int:
        return self.num_chunks * self.chunk_frames

    def video_frames(self, chunk: int) -> int:
        """Video frames chunk ``chunk`` (0-based) decodes to: ``1 + t (C - 1)`` for the first, ``t C`` after."""
        return self.temporal * self.chunk_frames - (self.temporal - 1 if chunk == 0 else 0)


def _latent_frames(num_frames: int, temporal: int) -> int | None:
    """Latent frames of ``num_frames`` video frames, ``None`` when the VAE cannot produce that count."""
    if num_frames < 1 or (num_frames - 1) % temporal:
        return None
    return (num_frames - 1) // temporal + 1


def _chunk_for(latent_frames: int, chunk_frames: int | None, patch: int) -> int | None:
    """The chunk size for a clip of ``latent_frames`` (``None``: the clip does not fit the rule)."""
    sizes = DEFAULT_CHUNK_FRAMES if chunk_frames is None else (chunk_frames,)
    for size in sizes:
        if size % patch == 0 and latent_frames % size == 0:
            return size
    return None


def stream_chunks(num_frames: int, chunk_frames: int | None = None, temporal: int = 4, patch: int = 1) -> StreamChunks:
    """Cut a video of ``num_frames`` frames into chunks of ``chunk_frames`` latent frames (default: see the module
    docstring); ``temporal``: the VAE's temporal factor, ``patch``: the transformer's temporal patch size.

    Raises ``ValueError`` naming the nearest frame counts that fit, when ``num_frames`` does not.
    """
    if chunk_frames is not None and (
        isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1
    ):
        raise ValueError(f"chunk_frames must be a positive number of latent frames, got {chunk_frames!r}")
    if chunk_frames is not None and chunk_frames % patch:
        raise ValueError(
            f"chunk_frames {chunk_frames} must be a multiple of the transformer's temporal patch size {patch}"
        )
    latent = _latent_frames(num_frames, temporal)
    size = None if latent is None else _chunk_for(latent, chunk_frames, patch)
    if size is None:
        chunk = (
            "chunks of 3, 2 or 1 latent frames" if chunk_frames is None else f"chunks of {chunk_frames} latent frames"
        )
        step = temporal * (chunk_frames or patch)
        rule = f"1 + {temporal} x (n x {chunk_frames} - 1)" if chunk_frames else f"{temporal}k + 1"
        nearest = " or ".join(map(str, _nearest(num_frames, lambda n: _fits(n, chunk_frames, temporal, patch), step)))
        raise ValueError(
            f"{num_frames} frames do not stream in {chunk}: a streamed video has {rule} frames "
            f"(Wan's VAE maps 1 + {temporal}k frames to 1 + k latent frames); nearest: {nearest}"
        )
    return StreamChunks(num_frames, size, latent // size, temporal)


def _fits(num_frames: int, chunk_frames: int | None, temporal: int, patch: int) -> bool:
    latent = _latent_frames(num_frames, temporal)
    return latent is not None and _chunk_for(latent, chunk_frames, patch) is not None


def _nearest(num_frames: int, fits, step: int) -> list[int]:
    """The largest count below ``num_frames`` and the smallest above it that ``fits`` (``step``: their spacing)."""
    below = next((n for n in range(num_frames - 1, max(num_frames - 2 * step - 2, 0), -1) if fits(n)), None)
    above = next(n for n in range(max(num_frames + 1, 1), max(num_frames, 1) + 2 * step + 2) if fits(n))
    return [n for n in (below, above) if n is not None]
