"""A tiny block-causal MHLA Wan pipeline (the ``causal_pipeline_dir`` fixture saves it) and a block-causal softmax
one, their streaming call, and the reference a stream must equal: each chunk denoised by one causal pass over the
clean earlier chunks."""

from __future__ import annotations

import numpy as np
import torch

from mhla_diffusion import MHLAConfig

#: The causal setting of the tiny pipeline: one temporal row mixed on its own, older rows folded with a decay;
#: 2 x 2 spatial blocks over the tiny clip's 2 x 3 tokens per frame (uneven blocks).
CAUSAL_CONFIG = dict(layout=(1, 2, 2), causal=True, causal_window=1, causal_fold="decay", gate=True)

#: A streamed call of the tiny pipeline: 2 latent frames per chunk (a base chunk of 5 frames), 4 chunks (29 frames).
STREAM_CALL = dict(
    prompt="a red circle moving left",
    negative_prompt="blue",
    height=32,
    width=48,
    num_frames=29,
    chunk_frames=2,
    num_inference_steps=2,
    guidance_scale=3.0,
    max_sequence_length=16,
)


def causal_tiny_pipeline():
    """The tiny Wan pipeline (``mhla_diffusion.models.tiny``) as a :class:`MHLAWanStreamingPipeline` whose transformer
    is converted with :data:`CAUSAL_CONFIG`, its MHLA parameters moved away from their initialisation (so every
    temporal offset, the fold and its decay change the output)."""
    from mhla_diffusion import MHLAWanStreamingPipeline
    from mhla_diffusion.models.tiny import tiny_wan_pipeline

    pipe = MHLAWanStreamingPipeline(**tiny_wan_pipeline().components)
    pipe.convert_to_mhla(MHLAConfig(**CAUSAL_CONFIG))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in pipe.transformer.named_parameters():
            if ".processor." in name:
                param.add_(0.3 * torch.rand(param.shape, generator=generator))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def block_causal_softmax_pipeline():
    """The tiny Wan pipeline as a :class:`MHLAWanStreamingPipeline` whose softmax self-attention is block-causal over
    latent frames with a KV cache (``use_kv_cache(transformer, block_causal=True)``, recorded in its config): the
    streaming teacher's kind."""
    from mhla_diffusion import MHLAWanStreamingPipeline
    from mhla_diffusion.models.kv_cache import use_kv_cache
    from mhla_diffusion.models.tiny import tiny_wan_pipeline

    pipe = MHLAWanStreamingPipeline(**tiny_wan_pipeline().components)
    use_kv_cache(pipe.transformer, block_causal=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def one_pass_stream(pipe, call: dict, generator: torch.Generator) -> np.ndarray:
    """What a stream must give, computed without a stream: each chunk denoised (same noise, schedule, guidance)
    by one causal pass of the transformer (block-causal MHLA or softmax) over the earlier chunks and the noisy chunk,
    unconditional and conditional as two separate calls, then the whole latent decoded by ``vae.decode``.
    The earlier chunks are clean (timestep 0), or with ``call["context_noise"]`` ``s`` each is noised once when it is
    finished, ``(1 - s) x + s n`` with ``n`` drawn from ``generator`` right after it, and read at timestep
    ``int(1000 s)``. ``call["first_chunk_frames"]``: the first chunk's latent frames (default ``chunk_frames``).
    ``call``: the pipeline's arguments (:data:`STREAM_CALL`). The frames ``(1, F, H, W, 3)``."""
    from diffusers.utils.torch_utils import randn_tensor

    transformer, scheduler, vae = pipe.transformer, pipe.scheduler, pipe.vae
    cond, uncond = pipe.encode_prompt(
        call["prompt"], call["negative_prompt"], max_sequence_length=call["max_sequence_length"], device="cpu"
    )
    chunk = call["chunk_frames"]
    first = call.get("first_chunk_frames") or chunk
    level = call.get("context_noise") or 0.0
    latent_frames = (call["num_frames"] - 1) // 4 + 1
    sizes = [first] + [chunk] * ((latent_frames - first) // chunk)
    tokens_per_frame = (call["height"] // 16) * (call["width"] // 16)
    clean, context_chunks = [], []
    for index, size in enumerate(sizes):
        shape = (1, 16, size, call["height"] // 8, call["width"] // 8)
        latents = randn_tensor(shape, generator=generator, dtype=torch.float32)
        scheduler.set_timesteps(call["num_inference_steps"])
        scheduler.set_begin_index(0)
        for t in scheduler.timesteps:
            context = sum(c.shape[2] for c in clean)
            per_frame = torch.cat([torch.full((context,), float(int(1000 * level))), t.float().expand(size)])
            timestep = per_frame.repeat_interleave(tokens_per_frame)[None]
            clip = torch.cat([*context_chunks, latents], dim=2)
            with torch.no_grad():
                pred = [
                    transformer(clip, timestep, text, return_dict=False)[0][:, :, context:] for text in (uncond, cond)
                ]
            noise = pred[0] + call["guidance_scale"] * (pred[1] - pred[0])
            latents = scheduler.step(noise, t, latents, return_dict=False)[0]
        clean.append(latents)
        if level > 0 and index < len(sizes) - 1:
            latents = (1 - level) * latents + level * randn_tensor(shape, generator=generator, dtype=torch.float32)
        context_chunks.append(latents)
    latents = torch.cat(clean, dim=2)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents * std + mean).sample
    return pipe.video_processor.postprocess_video(video, output_type="np")


def text_to_video_stream(folder, out, *extra: str, steps: int = 2, chunk_frames: str | None = "2") -> int:
    """``mhla text-to-video --stream`` on the causal tiny pipeline ``folder`` at :data:`STREAM_CALL`'s size (29 frames
    in chunks of ``chunk_frames`` latent frames, ``None``: the model's; the prompt and seed are the caller's),
    writing into ``out``; ``extra`` comes last (a repeated option there wins). The exit code."""
    from mhla_diffusion.cli import main

    chunks = ("--chunk-frames", chunk_frames) if chunk_frames is not None else ()
    size = ("--num-frames", "29", *chunks, "--height", "32", "--width", "48")
    return main(
        [
            "text-to-video",
            "--stream",
            "--model",
            str(folder),
            "--output-dir",
            str(out),
            *size,
            "--max-sequence-length",
            "16",
            "--steps",
            str(steps),
            *extra,
        ]
    )
