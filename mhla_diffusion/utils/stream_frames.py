"""The chunk rule of streaming generation (``MHLAWanStreamingPipeline``, ``mhla text-to-video --stream``).

A stream denoises ``chunk_frames`` latent frames at a time. Wan's VAE maps ``1 + 4k`` video frames to ``1 + k``
latent frames (``4``: its temporal factor ``t``), so a video of ``n`` whole chunks has
``1 + t * (n * chunk_frames - 1)`` frames: the first chunk decodes to ``1 + t * (chunk_frames - 1)`` frames, every
later one to ``t * chunk_frames``. With chunks of 3 latent frames: 9, 21, 33, 45, ... frames.

A stream may begin with a shorter chunk (``first_chunk_frames``, e.g. 1: the first latent frame alone, as Wan's VAE
encodes the first video frame alone): then ``1 + t * (first + (n - 1) * chunk_frames - 1)`` frames, so a first
chunk of 1 and chunks of 4 give ``1 + 4 t k`` frames (with ``t = 2``: 9, 17, 25, ..., 129).

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
    """How a streamed video is cut: ``num_chunks`` chunks of ``chunk_frames`` latent frames, the first of
    ``first_chunk_frames`` (``None``: ``chunk_frames`` too); ``temporal``: the VAE's temporal factor."""

    num_frames: int
    chunk_frames: int
    num_chunks: int
    temporal: int
    first_chunk_frames: int | None = None

    @property
    def first_frames(self) -> int:
        """Latent frames of the first chunk."""
        return self.chunk_frames if self.first_chunk_frames is None else self.first_chunk_frames

    @property
    def latent_frames(self) -> int:
        return self.first_frames + (self.num_chunks - 1) * self.chunk_frames

    def latent_frames_of(self, chunk: int) -> int:
        """Latent frames of chunk ``chunk`` (0-based)."""
        return self.first_frames if chunk == 0 else self.chunk_frames

    def video_frames(self, chunk: int) -> int:
        """Video frames chunk ``chunk`` (0-based) decodes to: ``1 + t (C1 - 1)`` for the first (``C1``: its latent
        frames), ``t C`` after."""
        if chunk == 0:
            return 1 + self.temporal * (self.first_frames - 1)
        return self.temporal * self.chunk_frames


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


def stream_chunks(
    num_frames: int,
    chunk_frames: int | None = None,
    temporal: int = 4,
    patch: int = 1,
    first_chunk_frames: int | None = None,
) -> StreamChunks:
    """Cut a video of ``num_frames`` frames into chunks of ``chunk_frames`` latent frames (default: see the module
    docstring); ``temporal``: the VAE's temporal factor, ``patch``: the transformer's temporal patch size;
    ``first_chunk_frames``: latent frames of the first chunk (``None``: ``chunk_frames``; needs ``chunk_frames``).

    Raises ``ValueError`` naming the nearest frame counts that fit, when ``num_frames`` does not.
    """
    if first_chunk_frames is not None and first_chunk_frames != chunk_frames:
        return _with_first_chunk(num_frames, chunk_frames, temporal, patch, first_chunk_frames)
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


def _with_first_chunk(num_frames: int, chunk_frames: int | None, temporal: int, patch: int, first: int) -> StreamChunks:
    """:func:`stream_chunks` with a first chunk of ``first`` latent frames and ``chunk_frames`` after it."""
    if chunk_frames is None:
        raise ValueError("first_chunk_frames needs chunk_frames: say how long the chunks after the first are")
    for name, value in (("chunk_frames", chunk_frames), ("first_chunk_frames", first)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive number of latent frames, got {value!r}")
        if value % patch:
            raise ValueError(f"{name} {value} must be a multiple of the transformer's temporal patch size {patch}")

    def fits(n: int) -> bool:
        latent = _latent_frames(n, temporal)
        return latent is not None and latent >= first and (latent - first) % chunk_frames == 0

    if not fits(num_frames):
        nearest = " or ".join(map(str, _nearest(num_frames, fits, temporal * chunk_frames)))
        raise ValueError(
            f"{num_frames} frames do not stream in a first chunk of {first} and chunks of {chunk_frames} latent "
            f"frames: a streamed video has 1 + {temporal} x ({first} + n x {chunk_frames} - 1) frames (Wan's VAE "
            f"maps 1 + {temporal}k frames to 1 + k latent frames); nearest: {nearest}"
        )
    latent = _latent_frames(num_frames, temporal)
    return StreamChunks(num_frames, chunk_frames, 1 + (latent - first) // chunk_frames, temporal, first)


def _fits(num_frames: int, chunk_frames: int | None, temporal: int, patch: int) -> bool:
    latent = _latent_frames(num_frames, temporal)
    return latent is not None and _chunk_for(latent, chunk_frames, patch) is not None


def _nearest(num_frames: int, fits, step: int) -> list[int]:
    """The largest count below ``num_frames`` and the smallest above it that ``fits`` (``step``: their spacing)."""
    below = next((n for n in range(num_frames - 1, max(num_frames - 2 * step - 2, 0), -1) if fits(n)), None)
    above = next(n for n in range(max(num_frames + 1, 1), max(num_frames, 1) + 2 * step + 2) if fits(n))
    return [n for n in (below, above) if n is not None]
