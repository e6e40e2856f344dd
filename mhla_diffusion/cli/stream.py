"""``mhla text-to-video --stream``: its options and the checks it runs before any model loads.

A streamed run generates with :class:`~mhla_diffusion.pipelines.wan_streaming.MHLAWanStreamingPipeline` and
appends each chunk's frames to the output video as they are decoded (``VideoWriter``), so neither the latents
nor the frames of the whole video are kept. Refused with one line before any work: a model that is not
block-causal (MHLA, or softmax trained with ``softmax_block_causal``), a frame count that does not fit the chunk
rule (naming the nearest that do), context parallelism, and formats that cannot be appended to.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..utils.geometry import VideoGeometry, read_component_config
from ..utils.stream_frames import BLOCK_CAUSAL_KEY, StreamChunks, stream_chunks
from .arguments import positive_int

__all__ = [
    "add_stream_arguments",
    "announce_stream",
    "check_stream",
    "check_stream_model",
    "stream_grid",
    "stream_settings",
]


def add_stream_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("streaming (long video from a block-causal MHLA model; docs/streaming.md)")
    group.add_argument(
        "--stream",
        action="store_true",
        help="generate chunk by chunk with a block-causal model (MHLAConfig(causal=True), or a softmax model trained "
        "with softmax_block_causal, streamed with a KV cache), appending each chunk's frames to the video file as "
        "they come (mp4 or frames; a killed run leaves a playable file): any length, memory flat; --num-frames "
        "must be 1 + t (n x C - 1) for n chunks of C latent frames, t the model's VAE time factor (Wan: 4; the "
        "embedded models: 2), or 1 + t (C1 + n x C - 1) with a first chunk of C1 that the model records",
    )
    group.add_argument(
        "--chunk-frames",
        type=positive_int,
        help="latent frames per chunk with --stream (default: the chunk the model records, with its first chunk; "
        "else 3, or 2 or 1 when 3 does not divide the video's latent frames); the first chunk gives 1 + t (C - 1) "
        "frames, every later one t C",
    )
    group.add_argument(
        "--state-dtype",
        choices=("float32", "bfloat16"),
        help="with --stream, the dtype a block-causal MHLA stream stores its carried block summaries in (default "
        "float32, exact; bfloat16: half the bytes, error in docs/streaming.md); they are mixed in float32 either way",
    )


def check_stream(args: argparse.Namespace, geometry: VideoGeometry) -> StreamChunks | None:
    """The chunks of a ``--stream`` run, ``None`` without ``--stream``; a ``ValueError`` naming the fix for what
    cannot stream (the checks that need no model; ``--chunk-frames`` without ``--stream`` too)."""
    from ..pipelines.outputs import VideoWriter

    if not args.stream:
        for flag, value in (("--chunk-frames", args.chunk_frames), ("--state-dtype", args.state_dtype)):
            if value is not None:
                raise ValueError(f"{flag} is for --stream: add --stream, or leave out {flag}")
        return None
    if args.context_parallel != 1:
        raise ValueError(
            "--stream has no context parallelism (the causal MHLA state of a stream is per process): leave out "
            "--context-parallel, or generate without --stream"
        )
    if args.format not in VideoWriter.FORMATS:
        raise ValueError(
            f"--stream appends frames to the video as they come, which --format {args.format} cannot take "
            f"(it is encoded whole at the end): use --format {' or '.join(VideoWriter.FORMATS)}"
        )
    first = getattr(args, "first_chunk_frames", None)  # a model's recorded first chunk (_apply_defaults)
    return stream_chunks(args.num_frames, args.chunk_frames, geometry.vae_scale_temporal, geometry.patch_size[0], first)


def check_stream_model(args: argparse.Namespace, declared: list[dict[str, Any]]) -> None:
    """Refuse a ``--stream`` model that is not block-causal, read without loading it: with ``--attention mhla`` its
    MHLA configs (``declared``: the ``mhla_config.json`` entries) need a causal layer; with ``--attention softmax``
    its transformer config needs the block-causal softmax mark
    (:data:`~mhla_diffusion.utils.stream_frames.BLOCK_CAUSAL_KEY`), streamed with a KV cache. A hub model not at hand
    is checked by the pipeline after loading."""
    marked = bool((read_component_config(args.model, "transformer") or {}).get(BLOCK_CAUSAL_KEY))
    if args.attention == "softmax":
        if args.state_dtype is not None:
            raise ValueError(
                "--state-dtype sets how a block-causal MHLA stream stores its state; --attention softmax streams with "
                "a KV cache in the model's dtype: leave out --state-dtype"
            )
        if marked or not os.path.isdir(args.model):
            return
        raise ValueError(
            f"--stream --attention softmax streams a block-causal softmax model with a KV cache and {args.model} is "
            "not one: train it with softmax_block_causal: true, or leave out --attention softmax to stream a "
            "block-causal MHLA model"
        )
    if any(meta["mhla_config"].get("causal") for meta in declared):
        return
    if declared or os.path.isdir(args.model):
        if marked:
            raise ValueError(
                f"{args.model} is a block-causal softmax model (no MHLA layers): stream it with --attention softmax"
            )
        what = "has MHLA layers, but not block-causal ones" if declared else "has no MHLA layers"
        raise ValueError(
            f"--stream needs a block-causal model and {args.model} {what}: convert it with "
            "MHLAConfig(causal=True) (pipe.convert_to_mhla, then fine-tune it) and save it, or stream a softmax model "
            "trained with softmax_block_causal: true (--attention softmax), or generate without --stream"
        )


def stream_settings(chunks: StreamChunks) -> dict[str, Any]:
    """What a streamed run adds to the settings JSON beside its video."""
    first = {} if chunks.first_chunk_frames is None else {"first_chunk_frames": chunks.first_chunk_frames}
    return {"stream": True, "chunk_frames": chunks.chunk_frames, **first, "num_chunks": chunks.num_chunks}


def stream_grid(geometry: VideoGeometry, chunks: StreamChunks, height: int, width: int) -> tuple[int, int, int]:
    """The token grid of a stream's largest chunk: what one attention call sees, and what the model's size limits
    apply to (each chunk keeps its frames' absolute positions, past the rotary table, so the video's length is
    not one of them). A ``ValueError`` for a frame size the model cannot take."""
    latent = max(chunks.first_frames, chunks.chunk_frames)
    return geometry.token_grid(1 + chunks.temporal * (latent - 1), height, width)


def announce_stream(chunks: StreamChunks, fps: int, steps: int) -> None:
    """Say on stderr, before the first chunk, how long the stream is and what it costs: the chunks, the transformer
    forwards (``steps`` per chunk, under guidance as one batch, plus one that adds the chunk to the state), and the
    length at ``fps``. The progress bar then shows the time per chunk and what is left."""
    seconds = chunks.num_frames / fps
    length = (
        f"{seconds:.1f} s"
        if seconds < 120
        else f"{seconds / 60:.1f} min"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h"
    )
    forwards = chunks.num_chunks * (steps + 1) - 1
    print(
        f"--stream: {chunks.num_frames:,} frames ({length} at {fps} fps) in {chunks.num_chunks:,} chunks: "
        f"{forwards:,} transformer forwards; each chunk's frames are in the file as soon as it is decoded, and "
        "Ctrl-C keeps them",
        file=sys.stderr,
    )
