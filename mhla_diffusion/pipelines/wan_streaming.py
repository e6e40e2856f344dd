"""Text-to-video as a stream: a block-causal Wan model generates a video of any length chunk by chunk.

:class:`MHLAWanStreamingPipeline` denoises ``chunk_frames`` latent frames at a time against the state the earlier
chunks left in every causal MHLA layer (:class:`~mhla_diffusion.models.streaming.CausalStream`: ``K + 1``
temporal rows of block summaries per layer, the same size after any number of chunks), or, for a block-causal
softmax model (the streaming teacher: :func:`~mhla_diffusion.models.kv_cache.use_kv_cache` with
``block_causal=True``, recorded in its transformer's config), in every layer's KV cache
(:class:`~mhla_diffusion.models.kv_cache.KVCacheStream`, one chunk of keys and values more per chunk); adds each
finished chunk to that state with one more forward at timestep 0, and decodes it with the Wan VAE's causal feature cache
kept between chunks (:class:`~mhla_diffusion.pipelines.stream_decoder.WanStreamingDecoder`). Each chunk's
frames go to ``on_frames`` as soon as they are decoded; no latent of an earlier chunk is kept. What is exact
(``docs/streaming.md``): every chunk is denoised as one block-causal pass over the clean earlier chunks and the
noisy current one would denoise it, and the decoded frames equal ``vae.decode`` of the whole latent.

The chunk rule (:mod:`mhla_diffusion.utils.stream_frames`): ``num_frames = 1 + 4 (n * chunk_frames - 1)``.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np
import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils.torch_utils import get_module_execution_device, randn_tensor

from ..models.kv_cache import KVCacheStream, kv_cache_processors, restore_block_causal
from ..models.streaming import CausalStream, ChunkStream, causal_processors
from ..models.text_cache import TextConditioningCache
from ..utils.model_defaults import RECORD_KEY
from ..utils.stream_frames import StreamChunks, stream_chunks
from .interrupt import GenerationInterrupted
from .stream_decoder import WanStreamingDecoder
from .wan import MHLAWanPipeline

__all__ = ["MHLAWanStreamingPipeline", "OUTPUT_TYPES"]

#: What ``output_type`` may be: decoded frames as NumPy, torch or PIL (as ``WanPipeline``), or the latents.
OUTPUT_TYPES = ("np", "pt", "pil", "latent")

#: The refusal of a streaming run under context parallelism.
CONTEXT_PARALLEL_ERROR = (
    "streaming generation has no context parallelism (its causal MHLA state or KV cache is per process): disable it "
    "(no transformer.enable_parallelism / enable_context_parallel; CLI: leave out --context-parallel) to stream"
)
#: The refusal of a transformer that is not block-causal (bidirectional MHLA or softmax).
NOT_CAUSAL_ERROR = (
    "this transformer has no block-causal MHLA layer and no block-causal softmax attention, so it cannot stream: "
    "convert it with MHLAConfig(causal=True), or train a softmax model block-causal (finetune option "
    "softmax_block_causal: true; use_kv_cache(transformer, block_causal=True)), or generate the whole clip in one pass"
)


class MHLAWanStreamingPipeline(MHLAWanPipeline):
    """``MHLAWanPipeline`` that generates chunk by chunk with a block-causal transformer (module docstring).

    Loading is :class:`MHLAWanPipeline`'s (``from_pretrained``, ``mhla_weights``, swapping schedulers). The
    transformer must have causal MHLA layers (``MHLAConfig(causal=True)``) or be block-causal softmax (KV-cache
    processors installed, or recorded in its config: :data:`~mhla_diffusion.models.kv_cache.BLOCK_CAUSAL_KEY`,
    which a ``softmax_block_causal`` training run saves); one transformer only (Wan2.1, or Wan2.2-TI2V-5B; not the
    two experts of Wan2.2-A14B).
    """

    _current_chunk: int | None = None

    @property
    def current_chunk(self) -> int | None:
        """The chunk being generated (0-based), for callbacks; ``None`` outside a call."""
        return self._current_chunk

    def check_stream(
        self,
        num_frames: int,
        height: int,
        width: int,
        chunk_frames: int | None,
        output_type: str = "np",
        first_chunk_frames: int | None = None,
    ) -> StreamChunks:
        """Raise ``ValueError`` for a stream this pipeline cannot run, before any work; return how it is cut.

        Checked: one transformer, block-causal (MHLA or softmax) and without context parallelism; ``output_type``;
        the chunk rule (naming the nearest frame counts that fit); height and width as ``WanPipeline`` allows them.
        """
        if getattr(self, "transformer_2", None) is not None or self.config.get("boundary_ratio") is not None:
            raise ValueError(
                "streaming runs one transformer: this pipeline has two (Wan2.2-A14B's experts); stream a "
                "one-transformer model (Wan2.1, Wan2.2-TI2V-5B) converted with MHLAConfig(causal=True)"
            )
        stream = self.make_stream()
        parallel = [getattr(self.transformer, "_parallel_config", None)]
        parallel += [getattr(processor, "_parallel_config", None) for processor in stream.processors]
        if any(config is not None for config in parallel):
            raise ValueError(CONTEXT_PARALLEL_ERROR)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
        geometry = self.geometry
        record = self.config.get(RECORD_KEY) or {}
        if chunk_frames is None:  # the chunks a block-causal model trained with, when its folder records them
            chunk_frames = record.get("chunk_frames")
            if first_chunk_frames is None:
                first_chunk_frames = record.get("first_chunk_frames")
        chunks = stream_chunks(
            num_frames, chunk_frames, geometry.vae_scale_temporal, geometry.patch_size[0], first_chunk_frames
        )
        # each chunk has its own positions (models/streaming.py): the length is unbounded, the frame size is not
        geometry.check_size(chunks.video_frames(0), height, width, generation=True)
        return chunks

    def make_stream(self, state_dtype: torch.dtype | None = None) -> ChunkStream:
        """A new stream of the transformer: :class:`~mhla_diffusion.models.streaming.CausalStream` for causal MHLA
        layers (its summaries stored in ``state_dtype``), :class:`~mhla_diffusion.models.kv_cache.KVCacheStream` for
        softmax KV-cache layers (put back here when its config records block-causal softmax); ``ValueError`` for a
        transformer that cannot stream."""
        transformer = self.transformer
        if causal_processors(transformer):
            return CausalStream(transformer, state_dtype)
        if restore_block_causal(transformer) or kv_cache_processors(transformer):
            if state_dtype is not None:
                raise ValueError(
                    "state_dtype sets how a block-causal MHLA stream stores its block summaries; this transformer "
                    "streams softmax attention with a KV cache, which keeps the model's dtype: leave out state_dtype"
                )
            return KVCacheStream(transformer)
        raise ValueError(NOT_CAUSAL_ERROR)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        chunk_frames: int | None = None,
        first_chunk_frames: int | None = None,
        context_noise: float | None = None,
        context_latents: torch.Tensor | None = None,
        state_dtype: torch.dtype | None = None,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        num_videos_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        callback_on_step_end: Callable[..., dict] | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],
        on_frames: Callable[[Any], None] | None = None,
        return_frames: bool = True,
        max_sequence_length: int = 512,
    ) -> WanPipelineOutput | tuple:
        """Generate a video chunk by chunk.

        Args are ``WanPipeline``'s where they share a name, plus:
            chunk_frames: latent frames per chunk; the video has ``1 + 4 (n * chunk_frames - 1)`` frames for
                ``n`` chunks (the first chunk decodes to ``1 + 4 (chunk_frames - 1)`` frames, every later one to
                ``4 * chunk_frames``). Default: the ``chunk_frames`` the pipeline's generation defaults record (what
                the Wan trainer trained a block-causal model with), else 3, or 2 or 1 when 3 does not divide the
                video's latent frames.
            first_chunk_frames: latent frames of the first chunk (default: ``chunk_frames``, or with no
                ``chunk_frames`` given, what the generation defaults record); e.g. 1 with chunks of 4: the video has
                ``1 + 4 t k`` frames (``t``: the VAE's temporal factor).
            context_noise: the noise level ``s`` in ``[0, 1)`` of the context a finished chunk leaves: it joins the
                state as ``(1 - s) x + s n`` (``n`` drawn from ``generator``) at timestep ``int(1000 s)``, as a model
                trained with ``causal_context_noise`` saw its context (it stops small errors from compounding
                chunk after chunk). Its frames are decoded clean. Default: the generation defaults'
                ``context_noise``, else 0 (the clean chunk at timestep 0, no draw).
            context_latents: the video's first chunks, given instead of generated: latents ``(B, C, F_c, h, w)`` as
                the transformer reads them (the VAE's latents minus ``latents_mean``, over ``latents_std``), ``F_c``
                the latent frames of the first ``k`` chunks (``B``: 1 or the batch). Those chunks are not denoised:
                each joins the state as a finished chunk does and is decoded as the video's first frames, and the
                stream continues from them. Their noise is still drawn, so a stream given its own first chunks
                with the same seed continues as it did.
            state_dtype: the dtype a block-causal MHLA stream stores its carried block summaries in: ``None``
                float32 (exact), ``torch.bfloat16`` half the bytes (its error: docs/streaming.md). They are mixed in
                float32 either way. Not for a softmax KV cache (which keeps the model's dtype).
            generator: each chunk draws its own noise from it, in order.
            callback_on_step_end: called after every step of every chunk as in Diffusers,
                ``callback(pipe, step, timestep, callback_kwargs)``; ``step`` counts within the chunk
                (``pipe.num_timesteps`` steps each) and ``pipe.current_chunk`` says which chunk it is. ``latents``
                are the chunk's ``(B, C, chunk_frames, h, w)``. Setting ``pipe._interrupt = True`` skips the chunk's
                remaining steps (as in Diffusers), decodes it and ends the video there.
            on_frames: called with each chunk's frames as soon as they are decoded, in ``output_type``'s form:
                ``np`` ``(B, F_chunk, H, W, 3)`` floats in ``[0, 1]``, ``pt`` ``(B, F_chunk, 3, H, W)``, ``pil`` a list
                per video, ``latent`` the chunk's latents ``(B, C, chunk_frames, h, w)``.
            return_frames: keep every chunk's frames to return them concatenated (``frames`` of the output).
                Their memory grows with the length: for long videos pass ``on_frames`` (e.g. a video file writer)
                and ``return_frames=False``, and the pipeline's memory stays flat (``frames`` is then ``None``).

        Every check runs before any work (:meth:`check_stream`, then ``WanPipeline.check_inputs``).
        Returns ``WanPipelineOutput(frames=...)`` (or ``(frames,)`` with ``return_dict=False``).
        """
        chunks = self.check_stream(num_frames, height, width, chunk_frames, output_type, first_chunk_frames)
        if context_noise is None:
            context_noise = float((self.config.get(RECORD_KEY) or {}).get("context_noise", 0.0))
        if isinstance(context_noise, bool) or not isinstance(context_noise, (int, float)) or not 0 <= context_noise < 1:
            raise ValueError(f"context_noise must be a noise level in [0, 1), got {context_noise!r}")
        given = self._context_chunks(chunks, context_latents, height, width)
        stream = self.make_stream(state_dtype)
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        self.check_inputs(
            prompt,
            negative_prompt,
            height,
            width,
            prompt_embeds,
            negative_prompt_embeds,
            callback_on_step_end_tensor_inputs,
            None,
        )
        if given:
            prompts = prompt_embeds.shape[0] if prompt is None else 1 if isinstance(prompt, str) else len(prompt)
            videos = prompts * num_videos_per_prompt
            if context_latents.shape[0] not in (1, videos):
                raise ValueError(
                    f"context_latents hold {context_latents.shape[0]} videos, the call makes {videos}: give 1 (for "
                    f"every video) or {videos}"
                )
        self._guidance_scale = guidance_scale
        self._guidance_scale_2 = None
        self._attention_kwargs = None
        self._current_timestep = None
        self._interrupt = False
        device = self._execution_device
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=self.do_classifier_free_guidance,
            num_videos_per_prompt=num_videos_per_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            max_sequence_length=max_sequence_length,
            device=device,
        )
        dtype = self.transformer.dtype
        batch = prompt_embeds.shape[0]
        latent_shape = [
            batch,
            self.transformer.config.in_channels,
            chunks.chunk_frames,
            height // self.vae_scale_factor_spatial,
            width // self.vae_scale_factor_spatial,
        ]
        decoder = WanStreamingDecoder(self.vae) if output_type != "latent" else None
        kept: list[Any] = []
        delivered = 0  # chunks handed on so far (on_frames, kept)
        try:
            with (
                self.progress_bar(total=chunks.num_chunks * num_inference_steps) as progress_bar,
                TextConditioningCache(self.transformer),  # text embedding and cross-attention K/V once per prompt
            ):
                for chunk in range(chunks.num_chunks):
                    self._current_chunk = chunk
                    progress_bar.set_description(f"chunk {chunk + 1}/{chunks.num_chunks}")
                    latent_shape[2] = chunks.latent_frames_of(chunk)
                    latents = randn_tensor(tuple(latent_shape), generator=generator, device=device, dtype=torch.float32)
                    if chunk < given:  # a chunk of the context: as given, not denoised
                        start = sum(chunks.latent_frames_of(c) for c in range(chunk))
                        frames_of = slice(start, start + latent_shape[2])
                        latents = context_latents[:, :, frames_of].to(device, torch.float32).expand_as(latents)
                        progress_bar.update(num_inference_steps)
                    else:
                        latents, prompt_embeds, negative_prompt_embeds = self._denoise_chunk(
                            stream,
                            latents,
                            prompt_embeds,
                            negative_prompt_embeds,
                            num_inference_steps,
                            device,
                            progress_bar,
                            callback_on_step_end,
                            callback_on_step_end_tensor_inputs,
                        )
                    last = chunk == chunks.num_chunks - 1 or self.interrupt
                    if not last:  # the finished chunk joins the state the next one reads
                        context = latents
                        if context_noise > 0:  # as the model saw its context in training (causal_context_noise)
                            noise = randn_tensor(latents.shape, generator=generator, device=device, dtype=latents.dtype)
                            context = (1.0 - context_noise) * latents + context_noise * noise
                        with stream.chunk(advance=True):
                            text = self._text(prompt_embeds, negative_prompt_embeds)
                            context = self._doubled(context.to(dtype))
                            level = torch.full(
                                (context.shape[0],), int(1000 * context_noise), device=device, dtype=torch.long
                            ).to(self.scheduler.timesteps.dtype)
                            self.transformer(
                                hidden_states=context, timestep=level, encoder_hidden_states=text, return_dict=False
                            )
                    frames = latents if decoder is None else self._decode(decoder, latents, output_type)
                    if on_frames is not None:
                        on_frames(frames)
                    if return_frames:
                        kept.append(frames)
                    delivered = chunk + 1
                    del latents, frames
                    if last:
                        break
        except KeyboardInterrupt as interrupt:  # Ctrl-C: what was delivered goes with the exception
            if isinstance(interrupt, GenerationInterrupted):
                raise
            frames = _concatenate(kept, output_type) if kept else None
            frames_kept = sum(chunks.video_frames(c) for c in range(delivered))
            raise GenerationInterrupted(frames_kept, num_frames, delivered, chunks.num_chunks, frames) from None
        finally:
            self._current_timestep = self._current_chunk = None
        self.maybe_free_model_hooks()
        video = _concatenate(kept, output_type) if return_frames else None
        if not return_dict:
            return (video,)
        return WanPipelineOutput(frames=video)

    def _context_chunks(
        self, chunks: StreamChunks, context_latents: torch.Tensor | None, height: int, width: int
    ) -> int:
        """How many whole first chunks ``context_latents`` holds (0 for ``None``); ``ValueError`` for latents that
        are not whole first chunks of this stream, before any work."""
        if context_latents is None:
            return 0
        latent_size = (height // self.vae_scale_factor_spatial, width // self.vae_scale_factor_spatial)
        channels = self.transformer.config.in_channels
        if not isinstance(context_latents, torch.Tensor) or context_latents.ndim != 5:
            raise ValueError(
                "context_latents must be latents (B, C, F, h, w), got "
                f"{getattr(context_latents, 'shape', type(context_latents).__name__)}"
            )
        if context_latents.shape[1] != channels or tuple(context_latents.shape[3:]) != latent_size:
            raise ValueError(
                f"context_latents {tuple(context_latents.shape)} do not fit this video: it needs {channels} channels "
                f"and {latent_size[0]}x{latent_size[1]} latents for {height}x{width} frames"
            )
        ends = list(itertools.accumulate(chunks.latent_frames_of(c) for c in range(chunks.num_chunks - 1)))
        if context_latents.shape[2] not in ends:
            raise ValueError(
                f"context_latents hold {context_latents.shape[2]} latent frames, which are not whole first chunks of "
                f"this stream: give the first {', '.join(map(str, ends[:4]))} ... latent frames (chunks end there; at "
                "least one chunk must be left to generate)"
            )
        return ends.index(context_latents.shape[2]) + 1

    def _doubled(self, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's batch: unconditional and conditional together under guidance (one stream each)."""
        return torch.cat([latents, latents]) if self.do_classifier_free_guidance else latents

    def _text(self, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None) -> torch.Tensor:
        text = torch.cat([negative_prompt_embeds, prompt_embeds]) if self.do_classifier_free_guidance else prompt_embeds
        return text.to(self.transformer.dtype)

    def _denoise_chunk(
        self,
        stream: ChunkStream,
        latents: torch.Tensor,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        num_inference_steps: int,
        device: torch.device,
        progress_bar: Any,
        callback_on_step_end: Callable[..., dict] | None,
        callback_on_step_end_tensor_inputs: list[str],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One chunk's denoising loop (Diffusers' ``WanPipeline`` loop, with a fresh schedule) against ``stream``."""
        scheduler = self.scheduler
        scheduler.set_timesteps(num_inference_steps, device=device)  # also resets a multistep scheduler's history
        scheduler.set_begin_index(0)
        timesteps = scheduler.timesteps
        self._num_timesteps = len(timesteps)
        warmup = len(timesteps) - num_inference_steps * scheduler.order
        for i, t in enumerate(timesteps):
            if self.interrupt:
                continue
            self._current_timestep = t
            model_input = self._doubled(latents.to(self.transformer.dtype))
            with stream.chunk():
                noise_pred = self.transformer(
                    hidden_states=model_input,
                    timestep=t.expand(model_input.shape[0]),
                    encoder_hidden_states=self._text(prompt_embeds, negative_prompt_embeds),
                    return_dict=False,
                )[0]
            if self.do_classifier_free_guidance:
                noise_uncond, noise_cond = noise_pred.chunk(2)
                noise_pred = noise_uncond + self.guidance_scale * (noise_cond - noise_uncond)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            if callback_on_step_end is not None:
                values = {"latents": latents, "prompt_embeds": prompt_embeds}
                values["negative_prompt_embeds"] = negative_prompt_embeds
                outputs = callback_on_step_end(self, i, t, {k: values[k] for k in callback_on_step_end_tensor_inputs})
                latents = outputs.pop("latents", latents)
                prompt_embeds = outputs.pop("prompt_embeds", prompt_embeds)
                negative_prompt_embeds = outputs.pop("negative_prompt_embeds", negative_prompt_embeds)
            if i == len(timesteps) - 1 or ((i + 1) > warmup and (i + 1) % scheduler.order == 0):
                progress_bar.update()
        return latents, prompt_embeds, negative_prompt_embeds

    def _decode(self, decoder: WanStreamingDecoder, latents: torch.Tensor, output_type: str) -> Any:
        """A chunk's latents -> its frames in ``output_type``'s form (``WanPipeline``'s un-normalisation)."""
        vae = self.vae
        latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        video = decoder.decode(latents * std + mean)
        return self.video_processor.postprocess_video(video, output_type=output_type)


def _concatenate(chunks: list[Any], output_type: str) -> Any:
    """Every chunk's frames as one video (frames after frames; latents along their frame axis)."""
    if output_type == "np":
        return np.concatenate(chunks, axis=1)
    if output_type == "pt":
        return torch.cat(chunks, dim=1)
    if output_type == "latent":
        return torch.cat(chunks, dim=2)
    return [sum((chunk[index] for chunk in chunks), []) for index in range(len(chunks[0]))]  # pil: a list per video
