"""Text-to-video fine-tuning: Wan2.1 / 2.2, SkyReels-V2 or HunyuanVideo converted to MHLA (or, with
``attention: softmax``, as it is), trained with flow matching. The family is the one of the transformer that
``pretrained_model``'s ``model_index.json`` names; what differs per family (text encoders, VAE normalisation, the
pipeline) is in :mod:`mhla_diffusion.finetune.video_families`.

    python -m mhla_diffusion.finetune.train_wan --config wan.yaml [--key value ...]
    accelerate launch -m mhla_diffusion.finetune.train_wan --config wan.yaml      # DDP / FSDP via accelerate config

Recipe (defaults, MHLA reference): logit-normal timesteps (0, 1) with shift 3, target noise - x0,
plain MSE; AdamW 2e-5 (0.9, 0.999, eps 1e-10, wd 0) with linear warmup then constant; clip 0.1;
bf16; gradient checkpointing; caption dropout 0.1 to the empty prompt. See ``finetune/README.md``.
Options beyond the recipe: ``distillation_weight`` (an MHLA student also matches its frozen softmax
original's output) and ``ema_decay`` (an EMA of the trained weights is what the run saves).

Block-causal MHLA (``mhla: {causal: true, ...}``, or a causal model to start from) trains by *diffusion forcing*:
the clip's latent frames are cut into chunks of ``causal_chunk_frames``, each chunk noised to its own level in one
causal pass (per-token timesteps ``(B, N)``), and each chunk but the last is, with probability
``causal_clean_chunks``, clean context (timestep 0, out of the loss). Why this, rather than only "clean context
plus one noisy current chunk": a causal pass predicts every chunk from the chunks before it, so one pass trains
every chunk at once, at every context length; a stream conditions on clean earlier chunks, which the clean chunks
show the model exactly (``causal_clean_chunks: 1`` is the clean-context scheme itself; 0 diffusion forcing
proper). See :func:`~mhla_diffusion.finetune.objectives.diffusion_forcing_inputs` and ``docs/finetune.md``.

A block-causal softmax model (``attention: softmax`` with ``softmax_block_causal: true``: the streaming teacher)
trains the same way: its self-attention layers get block-causal KV-cache processors
(:func:`~mhla_diffusion.models.kv_cache.use_kv_cache`), whose mark in the transformer's config is saved with it,
so ``MHLAWanStreamingPipeline`` streams the saved pipeline with a KV cache.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..loaders.loading import WAN_HUB_ID, check_model_source
from ..loaders.weights import save_mhla
from ..models.conversion import get_mhla_conversion
from ..models.kv_cache import is_block_causal, use_kv_cache
from ..models.teacher_forcing import TeacherForcing
from ..utils.geometry import VideoGeometry, check_layout_fits
from .components import (
    load_component,
    load_mhla_transformer,
    load_softmax_transformer,
    mhla_config_from_options,
    model_plan,
    pipeline_index,
    save_plain_transformer,
)
from .data import DataReport
from .engine import Task, TaskParts, resolve_dtype, run_task
from .latent_cache import LatentCache, encoder_identity, run_prepass
from .latents import draw_latents, encode_posterior
from .objectives import (
    FlowMatchInputs,
    diffusion_forcing_inputs,
    flow_match_inputs,
    flow_match_loss,
    teacher_forcing_inputs,
    training_chunks,
)
from .options import WanTrainOptions
from .trainable import add_lora
from .video_data import (
    CachedVideoDataset,
    VideoSample,
    VideoTextDataset,
    collate_cached_video,
    collate_pixels,
    index_video_folder,
    latent_identity,
)
from .video_families import VideoRecipe, WanRecipe, video_recipe_for

__all__ = ["WanTask", "main", "train"]

logger = logging.getLogger(__name__)


class WanTask(Task):
    """Data, model and loss of the text-to-video trainer (see :func:`mhla_diffusion.finetune.engine.run_task`)."""

    def __init__(self, options: WanTrainOptions) -> None:
        self.options = options
        self.vae = None
        self.cache: LatentCache | None = None
        self._prompt_cache: dict[str, dict[str, torch.Tensor]] = {}
        self._recipe: VideoRecipe | None = None
        self._model_defaults = None  # the pretrained model's generation defaults (read once)
        self.encoders: dict[str, Any] = {}  # the text components, once loaded
        self.original: nn.Module | None = None  # the frozen softmax original (distillation_weight > 0)
        self.causal = False  # block-causal MHLA or softmax: one noise level per chunk (diffusion forcing)
        self.stage = "train"

    # ------------------------------------------------------------------ setup

    @cached_property
    def _pretrained_plan(self) -> Any:
        """``pretrained_model``'s :class:`~mhla_diffusion.loaders.plan.LoadPlan`, resolved once for every load."""
        return model_plan(self.options.pretrained_model, self.options.revision)

    def setup(self, accelerator) -> TaskParts:
        o = self.options
        check_model_source(o.pretrained_model, WAN_HUB_ID, what="pretrained_model", revision=o.revision)
        index = self._index()
        for name in ("vae", *self.recipe.text_components, "transformer"):
            if not index.get(name) or index[name][0] is None:
                raise ValueError(
                    f"pretrained_model {o.pretrained_model} has no `{name}`: give a {self.recipe.label} text-to-video "
                    "pipeline"
                )
        if o.context_parallel_degree > 1 and not isinstance(self.recipe, WanRecipe):
            raise ValueError(
                f"context_parallel_degree {o.context_parallel_degree}: context parallelism trains Wan only; "
                f"train this {self.recipe.label} model with context_parallel_degree: 1"
            )
        self.device = accelerator.device
        self.encoder_dtype = {
            n: resolve_dtype(getattr(o, n), accelerator, wrapped=False) for n in ("vae_dtype", "text_encoder_dtype")
        }
        self.latent_channels = self._latent_channels()
        self._check_sizes()

        samples, report = self._index_data(accelerator)
        transformer = self._load_transformer(accelerator)
        self.causal = self._check_causal(transformer, accelerator)
        self._check_buckets(transformer, samples)
        self._check_context_parallel(samples)
        if o.cache_latents:
            samples, report = self._fill_cache(accelerator, samples, report)
        else:
            self._load_encoders(vae=True, text=True)
        if accelerator.is_main_process:
            report.warn()
        if o.trainable == "lora":
            add_lora(transformer, o.lora_rank, o.lora_alpha, o.lora_target_modules)

        if o.cache_latents:
            dataset, collate = CachedVideoDataset(self.cache, samples), collate_cached_video
        else:
            dataset = VideoTextDataset(samples, o.frame_stride, o.frame_sampling, o.seed)
            collate = collate_pixels
        return TaskParts(
            transformer=transformer,
            dataset=dataset,
            buckets=[s.bucket for s in samples],
            collate_fn=collate,
            batch_loss=self.batch_loss,
            save_final=self.save_final,
            validate=self.validate if o.validation_prompts else None,
            data_metrics=report.metrics(),
            finish=self.save_pipeline if o.save_pipeline else None,
            fid_samples=self.fid_samples,
            ema_decay=o.ema_decay,
            ema_warmup=o.ema_warmup,
            enter_stage=self._enter_stage,
        )

    @property
    def recipe(self) -> VideoRecipe:
        """The family's side of training (:mod:`~mhla_diffusion.finetune.video_families`), from the transformer
        class ``pretrained_model``'s ``model_index.json`` names (read once)."""
        if self._recipe is None:
            o = self.options
            entry = self._index().get("transformer") or (None, None)
            self._recipe = video_recipe_for(entry[1], o.pretrained_model)
        return self._recipe

    def _index(self) -> dict[str, Any]:
        """``pretrained_model``'s ``model_index.json`` (read once, by its plan)."""
        return pipeline_index(self._pretrained_plan)

    def _enter_stage(self, stage: str) -> None:
        self.stage = stage

    def _index_data(self, accelerator) -> tuple[list[VideoSample], DataReport]:
        from accelerate.utils import gather_object

        o = self.options
        if o.cache_latents:
            self.cache = LatentCache(o.resolved_cache_dir(), self._cache_settings())
            self.cache.check_settings()
            cached = self.cache.read_index()
            if cached is not None:
                logger.info(
                    "using the cached index of %d samples in %s (delete its index.json after changing the data)",
                    len(cached["samples"]),
                    self.cache.folder,
                )
                return [VideoSample.from_dict(s) for s in cached["samples"]], DataReport.from_dict(cached["report"])
        return index_video_folder(
            o.data_dir,
            o.bucket_sizes(),
            o.frame_counts(),
            o.frame_stride,
            o.caption_column,
            accelerator.process_index,
            accelerator.num_processes,
            gather_object,
            file_column=o.file_column,
        )

    def _cache_settings(self) -> dict[str, Any]:
        o = self.options
        return {
            "task": "wan",
            **encoder_identity(o.pretrained_model, o.revision, ("vae", *self.recipe.text_components)),
            "data_dir": str(Path(o.data_dir).resolve()),
            "resolution_buckets": o.bucket_sizes(),
            "frame_buckets": o.frame_counts(),
            "frame_stride": o.frame_stride,
            "caption_column": o.caption_column,
            "file_column": o.file_column,
            "max_sequence_length": o.max_sequence_length,
            "cache_dtype": o.cache_dtype,
            "latent_sampling": o.latent_sampling,
            "vae_dtype": str(self.encoder_dtype["vae_dtype"]),
            "text_encoder_dtype": str(self.encoder_dtype["text_encoder_dtype"]),
        }

    def _load_transformer(self, accelerator) -> nn.Module:
        o = self.options
        dtype = torch.float32 if o.trainable == "all" else resolve_dtype(o.frozen_dtype, accelerator)
        if o.attention == "softmax":
            transformer = load_softmax_transformer(self._pretrained_plan, dtype=dtype)
            if is_block_causal(transformer) and not o.softmax_block_causal:
                raise ValueError(
                    f"{o.pretrained_model}'s transformer is block-causal softmax (its config records it): set "
                    "softmax_block_causal: true to train it so, or start from a bidirectional model"
                )
            if o.softmax_block_causal:
                use_kv_cache(transformer, block_causal=True)
            if accelerator.is_main_process:
                how = "block-causal over latent frames" if o.softmax_block_causal else "as it is"
                logger.info("attention: softmax: training %s %s (no MHLA)", type(transformer).__name__, how)
            return transformer.train()
        config = mhla_config_from_options(o.mhla, o.mhla_preset)
        if config.layout == "auto" and config.target_grid is None:
            config.target_grid = self._geometry().token_grid(o.num_frames, o.height, o.width, strict=False)
        transformer, how = load_mhla_transformer(self._pretrained_plan, config, o.mhla_weights, None, dtype)
        if how == "saved" and (o.mhla or o.mhla_preset):
            logger.warning("%s already has MHLA layers; the `mhla` options are ignored", o.pretrained_model)
        if o.distillation_weight:
            if how == "saved":
                raise ValueError(
                    f"distillation_weight distils from the softmax original, but {o.pretrained_model} "
                    "holds an MHLA transformer: give the softmax pipeline it was converted from as "
                    "pretrained_model (and its MHLA weights as mhla_weights), or set distillation_weight: 0"
                )
            original = load_softmax_transformer(self._pretrained_plan, dtype=resolve_dtype(o.frozen_dtype, accelerator))
            self.original = original.eval().requires_grad_(False).to(accelerator.device)
        if accelerator.is_main_process:
            logger.info("%s", get_mhla_conversion(transformer).summary())
        return transformer.train()

    def _geometry(self) -> VideoGeometry:
        """The model's size rules, from its transformer and VAE configs (nothing loaded; read once)."""
        if getattr(self, "_video_geometry", None) is None:
            self._video_geometry = self.recipe.geometry(self._config("transformer"), self._config("vae"))
        return self._video_geometry

    def _config(self, component: str) -> dict[str, Any]:
        """The ``config.json`` of one component of ``pretrained_model`` (nothing loaded)."""
        return self._pretrained_plan.component_config(component, required=True)

    def _check_sizes(self) -> None:
        """Every training and validation size must be a whole number of patches of latents (see
        :class:`~mhla_diffusion.utils.geometry.VideoGeometry`); validation sizes also what ``WanPipeline`` accepts.
        Checked from the configs only."""
        o = self.options
        geometry = self._geometry()
        sizes = {(h, w): "resolution bucket" for h, w in o.bucket_sizes()}
        frames = {*o.frame_counts(), o.num_frames}
        if o.validation_prompts:
            frames.add(o.validation_num_frames or o.num_frames)
        checks = [((h, w), what, False) for (h, w), what in sorted(sizes.items())]
        if o.validation_prompts:
            checks.append(((o.validation_height or o.height, o.validation_width or o.width), "validation size", True))
        for (h, w), what, generation in checks:
            try:
                geometry.check_resolution(h, w, generation=generation)
            except ValueError as error:
                raise ValueError(f"{what} {h}x{w} (height x width): {error}") from None
        for count in sorted(frames):
            geometry.check_frames(count)

    def _check_causal(self, transformer: nn.Module, accelerator) -> bool:
        """Whether the loaded model is block-causal (MHLA converted so or saved so; softmax with
        ``softmax_block_causal``), with the ``causal_*`` options checked against it before any encoding: a chunk
        holds 1 .. the latent frames of ``num_frames``, and every latent frame is a frame of tokens (temporal patch
        1), whose timesteps the chunks set."""
        conversion = get_mhla_conversion(transformer)
        causal = conversion.config.causal if conversion is not None else is_block_causal(transformer)
        o = self.options
        o.check_causal(causal)
        if not causal:
            return False
        if not self.recipe.causal:
            raise ValueError(
                f"block-causal training (`mhla.causal`, or a causal model to start from) trains Wan only, whose "
                f"forward takes per-token timesteps; {o.pretrained_model} is a {self.recipe.label} pipeline: train "
                "it without causal"
            )
        geometry = self._geometry()
        if geometry.patch_size[0] != 1:
            raise ValueError(
                f"causal training sets timesteps per latent frame, but this model's patch "
                f"{'x'.join(map(str, geometry.patch_size))} puts {geometry.patch_size[0]} latent frames in one token: "
                "train it without causal"
            )
        frames = geometry.latent_shape(o.num_frames, o.height, o.width)[0]
        if o.causal_chunk_frames > frames:
            raise ValueError(
                f"causal_chunk_frames {o.causal_chunk_frames} is more than the {frames} latent frames of num_frames "
                f"{o.num_frames}: choose 1 .. {frames} (one chunk per clip would train one noise level, as without "
                "causal)"
            )
        if o.causal_first_chunk_frames is not None and o.causal_first_chunk_frames >= frames:
            raise ValueError(
                f"causal_first_chunk_frames {o.causal_first_chunk_frames} leaves no chunk after the first in the "
                f"{frames} latent frames of num_frames {o.num_frames}: choose 1 .. {frames - 1}"
            )
        if accelerator.is_main_process:
            first = "" if o.causal_first_chunk_frames is None else f" (the first of {o.causal_first_chunk_frames})"
            if o.causal_objective == "teacher_forcing":
                logger.info(
                    "block-causal: teacher forcing with chunks of %d latent frames%s: a clean copy and a noisy copy "
                    "of each clip, each noisy chunk reading the clean chunks before it",
                    o.causal_chunk_frames,
                    first,
                )
            else:
                logger.info(
                    "block-causal: diffusion forcing with chunks of %d latent frames%s, each but a clip's last clean "
                    "context with probability %g",
                    o.causal_chunk_frames,
                    first,
                    o.causal_clean_chunks,
                )
        return True

    def _check_buckets(self, transformer: nn.Module, samples: list[VideoSample]) -> None:
        """The MHLA block layout must run on every bucket's token grid (checked before any encoding).

        A bucket smaller than the layout on some axis (images: 1 frame) is fine, its extra blocks are
        empty; only normalization ``scalar_mixed_denominator`` needs a layout that divides each grid.
        """
        conversion = get_mhla_conversion(transformer)
        if conversion is None:  # attention: softmax
            return
        o = self.options
        geometry = self._geometry()
        buckets = {s.bucket for s in samples}
        if o.validation_prompts:
            buckets.add(
                (
                    o.validation_num_frames or o.num_frames,
                    o.validation_height or o.height,
                    o.validation_width or o.width,
                )
            )
        for bucket in sorted(buckets):
            kind = "images (1 frame)" if bucket[0] == 1 else f"{bucket[0]}-frame clips"
            check_layout_fits(
                geometry.token_grid(*bucket),
                conversion.layout,
                f"bucket {bucket[0]}x{bucket[1]}x{bucket[2]} ({kind})",
                conversion.config.normalization,
            )

    def _check_context_parallel(self, samples: list[VideoSample]) -> None:
        """With ``context_parallel_degree`` P, every training bucket's token count must be a multiple of P
        (Diffusers' even split; validation samples run unsplit on the main process)."""
        degree = self.options.context_parallel_degree
        if degree == 1:
            return
        geometry = self._geometry()
        for bucket in sorted({s.bucket for s in samples}):
            grid = geometry.token_grid(*bucket)
            tokens = math.prod(grid)
            if tokens % degree:
                raise ValueError(
                    f"context_parallel_degree {degree}: bucket {bucket[0]}x{bucket[1]}x{bucket[2]} has {tokens} tokens "
                    f"(grid {'x'.join(map(str, grid))}), not a multiple of {degree}, so its tokens can not be split "
                    "evenly across the processes: "
                    "choose frame_buckets / resolution_buckets whose token counts are multiples "
                    f"of {degree}, or another context_parallel_degree"
                )

    def _load_encoders(self, vae: bool, text: bool) -> None:
        if vae and self.vae is None:
            self.vae = load_component(self._pretrained_plan, "vae", None, self.encoder_dtype["vae_dtype"])
            self.vae.requires_grad_(False).eval().to(self.device)
            self.latent_shift, self.latent_scale = self.recipe.latent_normalization(self.vae)
        if text and not self.encoders:
            for name in self.recipe.text_components:
                if name.startswith("tokenizer"):
                    self.encoders[name] = load_component(self._pretrained_plan, name)
                else:
                    dtype = self.encoder_dtype["text_encoder_dtype"]
                    encoder = load_component(self._pretrained_plan, name, None, dtype)
                    self.encoders[name] = encoder.requires_grad_(False).eval().to(self.device)

    def _encode(self, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each prompt's unpadded text tensors (:meth:`VideoRecipe.encode`), loading the text encoders if needed."""
        self._load_encoders(vae=False, text=True)
        return self.recipe.encode(self.encoders, prompts, self.options.max_sequence_length)

    def _latent_channels(self) -> int:
        return self.recipe.latent_channels(self._config("vae"))

    # ------------------------------------------------------------------ latent cache pre-pass

    def _fill_cache(
        self, accelerator, samples: list[VideoSample], report: DataReport
    ) -> tuple[list[VideoSample], DataReport]:
        o = self.options
        cache = self.cache
        prompts = sorted({s.caption for s in samples} | {"", o.validation_negative_prompt} | set(o.validation_prompts))
        need_latents = [s for s in samples if not cache.has("latents", latent_identity(s))]
        need_prompts = [p for p in prompts if not cache.has("prompts", p)]
        if accelerator.is_main_process:
            cache.write_settings()
        accelerator.wait_for_everyone()
        if need_latents or need_prompts:
            self._load_encoders(vae=bool(need_latents), text=bool(need_prompts))
        dtype = getattr(torch, o.cache_dtype)
        if need_latents:
            pixels = VideoTextDataset(samples, o.frame_stride, "start", o.seed)

            def encode_latents(i: int) -> dict[str, torch.Tensor]:
                params = encode_posterior(
                    self.vae, pixels.load(i, 0)["pixels"][None], self.latent_shift, self.latent_scale
                )[0]
                stored = params if o.latent_sampling == "sample" else params[: params.shape[0] // 2]
                return {"latents": stored.to(dtype)}

            failures = run_prepass(
                accelerator, cache, "latents", [latent_identity(s) for s in samples], encode_latents, "caching latents"
            )
            if failures:
                bad = {i for i, _ in failures}
                report.corrupt.extend(samples[i].key for i in sorted(bad))
                samples = [s for i, s in enumerate(samples) if i not in bad]
                report.used = len(samples)
                if not samples:
                    raise ValueError(f"no usable files left after caching: {report.summary()}")
        if need_prompts:

            def encode_prompt(i: int) -> dict[str, torch.Tensor]:
                return {name: t.to(dtype) for name, t in self._encode([prompts[i]])[0].items()}

            run_prepass(accelerator, cache, "prompts", prompts, encode_prompt, "caching prompts")
        if accelerator.is_main_process:
            cache.write_index({"samples": [s.to_dict() for s in samples], "report": report.to_dict()})
        accelerator.wait_for_everyone()
        # Training reads the cache: the text encoder is never needed again; the VAE only to decode samples.
        self.encoders = {}
        if o.validation_prompts or o.validation_fid_reference:
            self._load_encoders(vae=True, text=False)
        else:
            self.vae = None
        return samples, report

    # ------------------------------------------------------------------ one step

    def _empty_embed(self) -> dict[str, torch.Tensor]:
        return self._embed("")

    def _embed(self, prompt: str) -> dict[str, torch.Tensor]:
        """A prompt's unpadded text tensors (Wan: ``{"prompt_embeds": (L, D)}``; cache or text encoders), kept on
        the device."""
        if prompt not in self._prompt_cache:
            if self.cache is not None and self.cache.has("prompts", prompt):
                encoded = self.cache.read("prompts", prompt)
            else:
                encoded = self._encode([prompt])[0]
            self._prompt_cache[prompt] = {name: t.to(self.device) for name, t in encoded.items()}
        return self._prompt_cache[prompt]

    def batch_loss(
        self, model: nn.Module, batch: dict[str, Any], generator: torch.Generator
    ) -> tuple[torch.Tensor, dict]:
        """Flow-matching loss of one batch (with ``distillation_weight``: mixed with the MSE to the softmax original's
        prediction for the same inputs). Random draws in a fixed order: caption dropout, latents, timesteps/noise."""
        o = self.options
        size = batch["indices"].shape[0]
        drop = (torch.rand(size, generator=generator, device=generator.device) < o.caption_dropout).tolist()
        if "latents" in batch:
            stored = batch["latents"]
            encoded = [self._empty_embed() if d else e for d, e in zip(drop, batch["text"])]
        else:
            stored = encode_posterior(self.vae, batch["pixels"], self.latent_shift, self.latent_scale)
            encoded = self._encode(["" if d else c for d, c in zip(drop, batch["captions"])])
        latents = draw_latents(stored.to(self.device), self.latent_channels, o.latent_sampling, generator)
        inputs = self._noised(latents, generator)
        encoded = [{name: t.to(self.device) for name, t in e.items()} for e in encoded]
        text = self.recipe.transformer_text(encoded, o.max_sequence_length)
        text.update(self.recipe.forward_extras(size, self.generation_defaults()["guidance_scale"], self.device))
        forcing = nullcontext()
        if self._teacher_forced():  # [clean | noisy]: each noisy chunk against the clean chunks before it
            chunks = training_chunks(latents.shape[2], o.causal_chunk_frames, o.causal_first_chunk_frames)
            forcing = TeacherForcing(_innermost(model), chunks)
        with forcing:
            prediction = model(hidden_states=inputs.noisy, timestep=inputs.timesteps, **text, return_dict=False)[0]
        loss = flow_match_loss(prediction, inputs.target, inputs.weight)
        if self.original is None or self.stage == "transfer":  # attention transfer uses only its layer losses
            return loss, {}
        with torch.no_grad():
            target = self.original(
                hidden_states=inputs.noisy.to(self.original.dtype),
                timestep=inputs.timesteps,
                **{k: v.to(self.original.dtype) if v.is_floating_point() else v for k, v in text.items()},
                return_dict=False,
            )[0]
        distillation = flow_match_loss(prediction, target, inputs.weight)
        w = o.distillation_weight
        return (1 - w) * loss + w * distillation, {
            "data_loss": loss.detach(),
            "distillation_loss": distillation.detach(),
        }

    def _noised(self, latents: torch.Tensor, generator: torch.Generator) -> FlowMatchInputs:
        """The flow-matching inputs of ``latents`` ``(B, C, F, H, W)``: one noise level per clip, or for a
        block-causal model one per chunk of ``causal_chunk_frames`` (per-token timesteps ``(B, N)``, clean chunks
        weighted 0 in the loss)."""
        o = self.options
        if not self.causal:
            return flow_match_inputs(latents, generator, o.logit_mean, o.logit_std, o.flow_shift)
        _, patch_h, patch_w = self._geometry().patch_size
        tokens_per_frame = (latents.shape[3] // patch_h) * (latents.shape[4] // patch_w)
        common = dict(
            logit_mean=o.logit_mean,
            logit_std=o.logit_std,
            shift=o.flow_shift,
            first_chunk_frames=o.causal_first_chunk_frames,
            context_noise=o.causal_context_noise,
        )
        if self._teacher_forced():
            return teacher_forcing_inputs(latents, generator, o.causal_chunk_frames, tokens_per_frame, **common)
        return diffusion_forcing_inputs(
            latents, generator, o.causal_chunk_frames, tokens_per_frame, o.causal_clean_chunks, **common
        )

    def _teacher_forced(self) -> bool:
        """Whether this step trains by teacher forcing (a block-causal model's main stage; attention transfer matches
        layers on plain inputs)."""
        return self.causal and self.options.causal_objective == "teacher_forcing" and self.stage != "transfer"

    # ------------------------------------------------------------------ outputs

    def save_final(self, model: nn.Module, name: str) -> Path:
        """``final``: MHLA weights (``mhla``), + LoRA file (``lora``), or the whole transformer (``all``/``attention``).

        ``attention: softmax``: the Diffusers transformer folder (``all``) or the LoRA file alone (``lora``)."""
        o = self.options
        folder = Path(o.output_dir) / name
        if o.attention == "softmax":
            if o.trainable == "all":
                save_plain_transformer(model, folder)
        elif o.trainable in ("mhla", "lora"):
            save_mhla(model, folder, overwrite=True)
        else:
            save_mhla(model, folder, include_base=True, overwrite=True)
        if o.trainable == "lora":
            from peft.utils import get_peft_model_state_dict

            # the adapter metadata keeps lora_alpha (scale alpha / rank) on reload
            self.recipe.pipeline_class().save_lora_weights(
                folder,
                transformer_lora_layers=get_peft_model_state_dict(model),
                transformer_lora_adapter_metadata=model.peft_config["default"].to_dict(),
            )
            from ..pipelines.lora import LORA_WEIGHT_NAME, mark_mhla_lora

            mark_mhla_lora(folder / LORA_WEIGHT_NAME, get_mhla_conversion(model))  # MHLAWanPipeline checks it on load
        logger.info("saved %s", folder)
        return folder

    def generation_defaults(self) -> dict[str, Any]:
        """What the saved pipeline generates by default (its ``_mhla_generation_defaults``): the frames, size and text
        length it trained at, the guidance of its validation samples (``validation_guidance_scale``, by default
        ``pretrained_model``'s own), the steps and frame rate of ``pretrained_model``, which training leaves as
        they were, and for a block-causal model the latent frames per chunk it trained with (``chunk_frames``, and
        ``first_chunk_frames`` when the first differs) and its context noise level (``context_noise``, when not 0).
        The flow shift it trained with goes into its scheduler (:meth:`_pipeline`)."""
        from ..utils.model_defaults import video_defaults

        o = self.options
        if self._model_defaults is None:  # read once (every training step asks the guidance)
            self._model_defaults = video_defaults(o.pretrained_model)
        start = self._model_defaults
        guidance = o.validation_guidance_scale
        if guidance is None and not isinstance(self.recipe, WanRecipe):
            guidance = self.recipe.default_guidance_scale  # the Wan defaults do not apply
        return {
            "num_frames": o.num_frames,
            "height": o.height,
            "width": o.width,
            "max_sequence_length": o.max_sequence_length,
            "guidance_scale": start.guidance_scale if guidance is None else guidance,
            "num_inference_steps": start.steps,
            "fps": start.fps,
            **({"chunk_frames": o.causal_chunk_frames} if self.causal else {}),  # the chunk it streams with
            **(
                {"first_chunk_frames": o.causal_first_chunk_frames}
                if self.causal and o.causal_first_chunk_frames not in (None, o.causal_chunk_frames)
                else {}
            ),
            **({"context_noise": o.causal_context_noise} if self.causal and o.causal_context_noise > 0 else {}),
        }

    def _pipeline(self, transformer: nn.Module, with_text: bool):
        """The family's pipeline around ``transformer`` (``MHLAWanPipeline`` for Wan, the stock one otherwise),
        with the flow shift it trained with, without text encoders unless ``with_text``."""
        o = self.options
        self._load_encoders(vae=True, text=with_text)
        scheduler = load_component(self._pretrained_plan, "scheduler")
        shift = next((key for key in ("flow_shift", "shift") if key in scheduler.config), None)
        if shift is not None:  # validation samples and the saved pipeline use the shift it trained with
            scheduler = type(scheduler).from_config(scheduler.config, **{shift: o.flow_shift})
        text = {name: self.encoders[name] if with_text else None for name in self.recipe.text_components}
        pipe = self.recipe.pipeline_class()(**text, vae=self.vae, transformer=transformer, scheduler=scheduler)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def validate(self, model: nn.Module, step: int) -> None:
        from .validation import write_video_samples

        o = self.options
        pipe = self._pipeline(model, with_text=False)
        negative = self._embed(o.validation_negative_prompt)
        texts = [
            self.recipe.pipeline_text(self._embed(p), negative, o.max_sequence_length) for p in o.validation_prompts
        ]
        write_video_samples(
            pipe,
            o.validation_prompts,
            texts,
            o.output_dir,
            step,
            num_frames=o.validation_num_frames or o.num_frames,
            height=o.validation_height or o.height,
            width=o.validation_width or o.width,
            num_inference_steps=o.validation_num_inference_steps,
            guidance_scale=self.generation_defaults()["guidance_scale"],
            seed=o.validation_seed,
            fps=o.validation_fps,
        )

    def fid_samples(self, model: nn.Module, indices: list[int]):
        """Per-frame validation-FID images: clip ``i`` for ``validation_prompts[i % len]`` seeded by
        ``(validation_seed, i)``, every frame of every clip one uint8 ``(H, W, 3)`` image."""
        import numpy as np

        from ..eval.sample import sample_seed, to_uint8

        o = self.options
        pipe = self._pipeline(model, with_text=False)
        negative = self._embed(o.validation_negative_prompt)
        frames = []
        for i in indices:
            prompt = o.validation_prompts[i % len(o.validation_prompts)]
            clip = pipe(
                **self.recipe.pipeline_text(self._embed(prompt), negative, o.max_sequence_length),
                num_frames=o.validation_num_frames or o.num_frames,
                height=o.validation_height or o.height,
                width=o.validation_width or o.width,
                num_inference_steps=o.validation_num_inference_steps,
                guidance_scale=self.generation_defaults()["guidance_scale"],
                generator=torch.Generator("cpu").manual_seed(sample_seed(o.validation_seed, i)),
                output_type="np",
            ).frames[0]
            frames.append(to_uint8(np.asarray(clip)))
        return np.concatenate(frames)

    def save_pipeline(self, model: nn.Module) -> None:
        """``<output_dir>/pipeline``: a full MHLAWanPipeline folder (LoRA fused into the base weights); a
        plain WanPipeline folder for ``attention: softmax``. Either records its :meth:`generation_defaults`, so
        ``mhla text-to-video --model <output_dir>/pipeline`` needs no size.

        Other families: the stock pipeline's folder, whose ``transformer/`` holds the whole MHLA transformer
        (``save_mhla(include_base=True)``: its ``config.json`` has the MHLA setting, so ``load_mhla`` and
        ``mhla generate`` rebuild MHLA; Diffusers' own loader would load it as softmax, with a warning)."""
        transformer = model
        if self.options.trainable == "lora":
            transformer = copy.deepcopy(model)
            transformer.fuse_lora()
            transformer.unload_lora()
        folder = Path(self.options.output_dir) / "pipeline"
        pipe = self._pipeline(transformer, with_text=True)
        if isinstance(self.recipe, WanRecipe):
            pipe.record_generation_defaults(**self.generation_defaults())
            pipe.save_pretrained(folder)
        else:
            pipe.save_pretrained(folder)
            if get_mhla_conversion(transformer) is not None:
                save_mhla(transformer, folder / "transformer", include_base=True, overwrite=True)
        logger.info("saved pipeline %s", folder)


def train(options: WanTrainOptions, on_step_end=None) -> Path:
    """Run the text-to-video trainer; returns the final output folder."""
    return run_task(WanTask(options), on_step_end=on_step_end)


def main(argv: Sequence[str] | None = None) -> int:
    from .entry import main as trainer_main

    return trainer_main("wan", argv)


if __name__ == "__main__":
    sys.exit(main())


def _innermost(model: nn.Module) -> nn.Module:
    """The transformer inside Accelerate's wrappers (DDP's ``module``, ``torch.compile``'s ``_orig_mod``)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
