"""Class-to-image fine-tuning: DiT converted to MHLA (or, with ``attention: softmax``, as it is),
trained with DiT's epsilon (+ VB) objective.

    python -m mhla_diffusion.finetune.train_dit --config dit.yaml [--key value ...]
    accelerate launch -m mhla_diffusion.finetune.train_dit --config dit.yaml

Recipe (defaults, MHLA reference): uniform timesteps on the model's DDPM betas, MSE on epsilon plus
the variational bound for the learned variance; AdamW 1e-4, constant, no clipping; EMA 0.9999 of
every step; class dropout 0.1 to the null class done here (the model's own ``LabelEmbedding``
dropout is switched off); mixing coefficients clamped to [0, 1] after every step.

From scratch (``model_size: DiT-S/2`` ... instead of ``pretrained_model``): the transformer is built
with DiT's initialisation (:mod:`.dit_scratch`), the VAE comes from ``vae_model`` (not loaded at all
when the latents are already cached and nothing is decoded), the scheduler from DiT's schedule.
With ``flip_coin_per_batch`` one coin per batch flips every image or none (released recipe).
"""

from __future__ import annotations

import logging
import sys
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..loaders.loading import DIT_HUB_ID, check_model_source
from ..loaders.weights import save_mhla
from ..models.conversion import get_mhla_conversion
from ..utils.dit_sizes import dit_transformer_config
from ..utils.geometry import ImageGeometry, check_layout_fits
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
from .dit_scratch import (
    dit_scheduler,
    load_vae,
    load_vae_config,
    new_dit_transformer,
    unshared_embedders,
    vae_location,
    vae_plan,
)
from .engine import Task, TaskParts, resolve_dtype, run_task
from .image_data import (
    CachedImageDataset,
    ClassImageDataset,
    ImageSample,
    batch_view,
    collate_cached_images,
    collate_images,
    count_classes,
    flip_coin,
    index_class_folder,
    latent_identity,
)
from .latent_cache import LatentCache, encoder_identity, run_prepass
from .latents import dit_latent_normalization, draw_latents, encode_posterior, presample
from .objectives import DiffusionObjective
from .options import DEFAULT_DIT_VAE, DiTTrainOptions

__all__ = ["DiTTask", "clamp_mixing", "disable_label_dropout", "folder_labels", "main", "train"]

logger = logging.getLogger(__name__)


def disable_label_dropout(transformer: nn.Module) -> int:
    """Switch off the random label dropping of every ``LabelEmbedding`` (each block draws its own in
    train mode); class dropout is done once per sample by the trainer. Returns how many were found."""
    from diffusers.models.embeddings import LabelEmbedding

    found = 0
    for module in transformer.modules():
        if isinstance(module, LabelEmbedding):
            module.dropout_prob = 0.0
            found += 1
    return found


@torch.no_grad()
def clamp_mixing(transformer: nn.Module) -> None:
    """Clamp every MHLA mixing matrix to [0, 1] (the reference does this after each DiT step; nothing
    to do without MHLA)."""
    conversion = get_mhla_conversion(transformer)
    for name in conversion.layer_names if conversion is not None else ():
        transformer.get_submodule(name).processor.mixing.clamp_(0.0, 1.0)


def folder_labels(samples: list[ImageSample]) -> dict[int, str]:
    """``{class id: class folder name}`` of the training images: the ``id2label`` written to the output
    pipelines when ``pretrained_model`` has none (folders ``0``..``9`` -> ``{0: "0", ..., 9: "9"}``)."""
    labels: dict[int, str] = {}
    for sample in samples:
        labels.setdefault(int(sample.label), Path(sample.key).parts[0])
    return dict(sorted(labels.items()))


class DiTTask(Task):
    """Data, model and loss of the class-to-image trainer."""

    def __init__(self, options: DiTTrainOptions) -> None:
        self.options = options
        self.vae = None
        self.cache: LatentCache | None = None

    @cached_property
    def _pretrained_plan(self) -> Any:
        """``pretrained_model``'s :class:`~mhla_diffusion.loaders.plan.LoadPlan`, resolved once for every load."""
        return model_plan(self.options.pretrained_model, self.options.revision)

    @cached_property
    def _vae_plan(self) -> Any:
        """``vae_model``'s :class:`~mhla_diffusion.loaders.plan.LoadPlan` (a from-scratch run's VAE), resolved once."""
        return vae_plan(self.options.vae_model)

    def setup(self, accelerator) -> TaskParts:
        from accelerate.utils import DistributedType

        o = self.options
        self.device = accelerator.device
        self.vae_dtype = resolve_dtype("auto", accelerator, wrapped=False)
        if o.model_size is None:
            check_model_source(o.pretrained_model, DIT_HUB_ID, what="pretrained_model", revision=o.revision)
            index = pipeline_index(self._pretrained_plan)
            for name in ("vae", "transformer", "scheduler"):
                if not index.get(name) or index[name][0] is None:
                    raise ValueError(f"pretrained_model {o.pretrained_model} has no `{name}`: give a DiT pipeline")
            self.id2label = index.get("id2label")
        else:
            check_model_source(o.vae_model, DEFAULT_DIT_VAE, what="vae_model")
            if o.share_embedder and accelerator.distributed_type == DistributedType.FSDP:
                raise ValueError(
                    "share_embedder ties one embedder to every block, which FSDP cannot shard: "
                    "use DDP, or share_embedder: false"
                )
            self.id2label = None
        self._check_sizes()  # config files only: before the cache reads the VAE and before any weights load
        if o.cache_latents:
            self.cache = LatentCache(o.resolved_cache_dir(), self._cache_settings())
            self.cache.check_settings()

        if o.model_size is None:
            transformer = self._load_transformer(accelerator)
            vae_config = self._pretrained_plan.component_config("vae", required=True)
            self.vae_scale = ImageGeometry.from_configs(vae=vae_config).vae_scale
        else:
            transformer = self._new_transformer(accelerator)
        self.num_classes = int(transformer.config.num_embeds_ada_norm)
        self.in_channels = int(transformer.config.in_channels)
        self._check_resolution(transformer)
        samples, report = self._index_data(accelerator)
        if not self.id2label:
            self.id2label = folder_labels(samples)
        if o.validation_classes:
            from ..pipelines.class_labels import label_index, resolve_class_ids

            resolve_class_ids(list(o.validation_classes), label_index(self.id2label), self.num_classes)
        if o.cache_latents:
            samples, report = self._fill_cache(accelerator, samples, report)
        else:
            self._load_vae()
        if accelerator.is_main_process:
            report.warn()
        if disable_label_dropout(transformer) == 0:
            raise ValueError(
                "the DiT transformer has no LabelEmbedding: class-conditional training needs num_embeds_ada_norm"
            )

        scheduler = self._scheduler()
        from diffusers import DDPMScheduler

        out_channels = int(transformer.config.out_channels or self.in_channels)
        self.objective = DiffusionObjective(
            DDPMScheduler.from_config(scheduler.config),
            learned_sigma=out_channels == 2 * self.in_channels,
            vb=o.learned_sigma_loss == "vb",
        )
        per_image_flip = o.random_flip and not o.flip_coin_per_batch  # else one coin per batch in batch_loss
        if o.cache_latents:
            dataset = CachedImageDataset(self.cache, samples, per_image_flip, o.seed, both_views=o.flip_coin_per_batch)
            collate = collate_cached_images
        else:
            dataset, collate = ClassImageDataset(samples, o.resolution, per_image_flip, o.seed), collate_images
        return TaskParts(
            transformer=transformer,
            dataset=dataset,
            buckets=[0] * len(samples),
            collate_fn=collate,
            batch_loss=self.batch_loss,
            save_final=self.save_final,
            validate=self.validate if o.validation_classes else None,
            after_optimizer_step=clamp_mixing if o.clamp_mixing and o.attention == "mhla" else None,
            ema_decay=o.ema_decay,
            ema_warmup=o.ema_warmup,
            data_metrics=report.metrics(),
            finish=self.save_pipeline if o.save_pipeline else None,
            fid_samples=self.fid_samples,
        )

    def _load_transformer(self, accelerator) -> nn.Module:
        o = self.options
        dtype = torch.float32 if o.trainable == "all" else resolve_dtype(o.frozen_dtype, accelerator)
        if o.attention == "softmax":
            transformer = load_softmax_transformer(self._pretrained_plan, dtype=dtype)
            if accelerator.is_main_process:
                logger.info("attention: softmax: training %s as it is (no MHLA)", type(transformer).__name__)
            return transformer.train()
        config = mhla_config_from_options(o.mhla, o.mhla_preset)
        transformer, how = load_mhla_transformer(self._pretrained_plan, config, o.mhla_weights, None, dtype)
        if how == "saved" and (o.mhla or o.mhla_preset):
            logger.warning("%s already has MHLA layers; the `mhla` options are ignored", o.pretrained_model)
        if accelerator.is_main_process:
            logger.info("%s", get_mhla_conversion(transformer).summary())
        return transformer.train()

    def _new_transformer(self, accelerator) -> nn.Module:
        """``model_size`` at random initialisation (DiT's), converted with the ``mhla`` options unless softmax."""
        o = self.options
        num_classes = count_classes(o.data_dir, o.class_map) if o.num_classes == "data" else int(o.num_classes)
        self.vae_scale, channels = self._latent_format()
        config = dit_transformer_config(
            o.model_size,
            sample_size=max(1, o.resolution // self.vae_scale),
            in_channels=channels,
            num_classes=num_classes,
            overrides=o.model_overrides,
        )
        geometry = ImageGeometry(self.vae_scale, int(config["patch_size"]))
        if o.resolution % geometry.size_multiple:
            raise ValueError(
                f"`resolution` {o.resolution} must be a multiple of {geometry.size_multiple} ({geometry.describe()})"
            )
        mhla = None if o.attention == "softmax" else mhla_config_from_options(o.mhla, o.mhla_preset)
        transformer = new_dit_transformer(config, o.seed, mhla, share=o.share_embedder)
        if accelerator.is_main_process:
            params = sum(p.numel() for p in transformer.parameters()) / 1e6
            logger.info(
                "%s from random initialisation (%.2fM parameters, %d classes, %s attention)",
                o.model_size,
                params,
                num_classes,
                o.attention,
            )
            conversion = get_mhla_conversion(transformer)
            if conversion is not None:
                logger.info("%s", conversion.summary())
        return transformer.train()

    def _latent_format(self) -> tuple[int, int]:
        """``(VAE scale, latent channels)`` of a ``model_size`` run: from a complete latent cache (no VAE
        needed), else from ``vae_model``'s config."""
        o = self.options
        cached = self.cache.read_index() if self.cache is not None else None
        if cached is not None and cached["samples"]:
            first = ImageSample.from_dict(cached["samples"][0])
            latents = self.cache.read("latents", latent_identity(first))["latents"]
            channels = latents.shape[0] // (2 if o.latent_sampling == "sample" else 1)
            return o.resolution // latents.shape[-1], channels
        config = load_vae_config(self._vae_plan)
        return ImageGeometry.from_configs(vae=config).vae_scale, int(config.get("latent_channels", 4))

    def _scheduler(self):
        o = self.options
        if o.model_size is not None:
            return dit_scheduler()
        return load_component(self._pretrained_plan, "scheduler")

    def _check_sizes(self) -> None:
        """``resolution`` against the VAE scale x patch size that the config files give (``pretrained_model``'s
        ``vae/`` and ``transformer/`` configs; or ``model_size``'s patch, ``model_overrides`` and ``vae_model``'s
        config), before any weights load; :meth:`_check_resolution` fits the MHLA layout once the model exists."""
        o = self.options
        if o.model_size is None:
            plan = self._pretrained_plan
            transformer = plan.component_config("transformer", required=True)
            vae = plan.component_config("vae", required=True)
            geometry = ImageGeometry.from_configs(transformer, vae)
        else:
            if o.cache_latents and LatentCache(o.resolved_cache_dir(), {}).read_index() is not None:
                return  # a complete cache gives the VAE scale, and vae_model need not be readable (_latent_format)
            patch = dit_transformer_config(o.model_size, 1, overrides=o.model_overrides)["patch_size"]
            geometry = ImageGeometry.from_configs({"patch_size": patch}, load_vae_config(self._vae_plan))
        if o.resolution % geometry.size_multiple:
            raise ValueError(
                f"`resolution` {o.resolution} must be a multiple of {geometry.size_multiple} ({geometry.describe()}, "
                "from the model's config files)"
            )

    def _check_resolution(self, transformer: nn.Module) -> None:
        o = self.options
        geometry = ImageGeometry(self.vae_scale, int(transformer.config.patch_size))
        step = geometry.size_multiple
        if o.resolution % step:
            raise ValueError(f"`resolution` {o.resolution} must be a multiple of {step} ({geometry.describe()})")
        conversion = get_mhla_conversion(transformer)
        if conversion is not None:
            check_layout_fits(
                geometry.token_grid(o.resolution, o.resolution),
                conversion.layout,
                f"`resolution` {o.resolution}",
                conversion.config.normalization,
            )
        native = int(transformer.config.sample_size) * geometry.vae_scale
        if o.resolution != native:
            logger.warning("training at %d px, the model was built for %d px", o.resolution, native)

    def _cache_settings(self) -> dict[str, Any]:
        o = self.options
        if o.model_size is None:
            encoder = encoder_identity(o.pretrained_model, o.revision, ("vae",))
        else:
            source, subfolder = vae_location(self._vae_plan)
            encoder = encoder_identity(source, None, (subfolder or ".",))
        return {
            "task": "dit",
            **encoder,
            "data_dir": str(Path(o.data_dir).resolve()),
            "resolution": o.resolution,
            "random_flip": o.random_flip,
            "class_map": o.class_map,
            "cache_dtype": o.cache_dtype,
            "latent_sampling": o.latent_sampling,
            "vae_dtype": str(self.vae_dtype),
        }

    def _index_data(self, accelerator) -> tuple[list[ImageSample], DataReport]:
        from accelerate.utils import gather_object

        o = self.options
        if o.cache_latents:
            cached = self.cache.read_index()
            if cached is not None:
                logger.info("using the cached index of %d images in %s", len(cached["samples"]), self.cache.folder)
                return [ImageSample.from_dict(s) for s in cached["samples"]], DataReport.from_dict(cached["report"])
        samples, report, _ = index_class_folder(
            o.data_dir,
            self.num_classes,
            o.class_map,
            accelerator.process_index,
            accelerator.num_processes,
            gather_object,
        )
        return samples, report

    def _load_vae(self) -> None:
        if self.vae is None:
            o = self.options
            if o.model_size is None:
                self.vae = load_component(self._pretrained_plan, "vae", None, self.vae_dtype)
            else:
                self.vae = load_vae(self._vae_plan, self.vae_dtype)
            self.vae.requires_grad_(False).eval().to(self.device)
            self.latent_shift, self.latent_scale = dit_latent_normalization(self.vae)

    def _fill_cache(
        self, accelerator, samples: list[ImageSample], report: DataReport
    ) -> tuple[list[ImageSample], DataReport]:
        o = self.options
        if accelerator.is_main_process:
            self.cache.write_settings()
        accelerator.wait_for_everyone()
        need = [s for s in samples if not self.cache.has("latents", latent_identity(s))]
        if need:
            self._load_vae()
            pixels = ClassImageDataset(samples, o.resolution, random_flip=False)
            dtype = getattr(torch, o.cache_dtype)

            def encode(i: int) -> dict[str, torch.Tensor]:
                image = pixels.load(i, 0)["pixels"][None]
                views = {"latents": image, **({"latents_flipped": image.flip(-1)} if o.random_flip else {})}
                out = {}
                for key, view in views.items():
                    params = encode_posterior(self.vae, view, self.latent_shift, self.latent_scale)[0]
                    channels = params.shape[0] // 2
                    if o.latent_sampling == "presampled":  # one draw, kept (released DiT's pre-extracted latents)
                        stored = presample(params, channels, [*latent_identity(samples[i]), key])
                    else:
                        stored = params if o.latent_sampling == "sample" else params[:channels]
                    out[key] = stored.to(dtype)
                return out

            failures = run_prepass(
                accelerator, self.cache, "latents", [latent_identity(s) for s in samples], encode, "caching latents"
            )
            if failures:
                bad = {i for i, _ in failures}
                report.corrupt.extend(samples[i].key for i in sorted(bad))
                samples = [s for i, s in enumerate(samples) if i not in bad]
                report.used = len(samples)
                if not samples:
                    raise ValueError(f"no usable images left after caching: {report.summary()}")
        if accelerator.is_main_process:
            self.cache.write_index({"samples": [s.to_dict() for s in samples], "report": report.to_dict()})
        accelerator.wait_for_everyone()
        if o.validation_classes or o.save_pipeline or o.validation_fid_reference:
            self._load_vae()
        else:
            self.vae = None
        return samples, report

    def batch_loss(
        self, model: nn.Module, batch: dict[str, Any], generator: torch.Generator
    ) -> tuple[torch.Tensor, dict]:
        """Epsilon (+ VB) loss of one batch. Random draws: the batch's flip coin (``flip_coin_per_batch``),
        class dropout, latents, timesteps/noise."""
        o = self.options
        extra = {}
        if o.flip_coin_per_batch:
            flipped = flip_coin(generator)
            batch = batch_view(batch, flipped)
            extra["flipped"] = float(flipped)
        labels = batch["labels"]
        drop = torch.rand(labels.shape[0], generator=generator, device=generator.device) < o.class_dropout
        labels = torch.where(drop.to(labels.device), torch.full_like(labels, self.num_classes), labels)
        if "latents" in batch:
            stored = batch["latents"]
        else:
            stored = encode_posterior(self.vae, batch["pixels"], self.latent_shift, self.latent_scale)
        latents = draw_latents(stored.to(self.device), self.in_channels, o.latent_sampling, generator)
        noisy, timesteps, noise = self.objective.sample_inputs(latents, generator)
        output = model(hidden_states=noisy, timestep=timesteps, class_labels=labels, return_dict=False)[0]
        loss, parts = self.objective.loss(output, latents, noisy, timesteps, noise)
        return loss, {**parts, **extra}

    def save_final(self, model: nn.Module, name: str) -> Path:
        """``final``: MHLA weights only (``trainable: mhla``) or the whole converted transformer; the
        plain Diffusers transformer for ``attention: softmax``."""
        folder = Path(self.options.output_dir) / name
        with unshared_embedders(model):  # a from-scratch model's shared embedder saved as Diffusers' per-block copies
            if self.options.attention == "softmax":
                save_plain_transformer(model, folder)
            else:
                save_mhla(model, folder, include_base=self.options.trainable != "mhla", overwrite=True)
        logger.info("saved %s", folder)
        return folder

    def _pipeline(self, transformer: nn.Module):
        from ..pipelines import MHLADiTPipeline

        self._load_vae()
        scheduler = self._scheduler()
        pipe = MHLADiTPipeline(transformer=transformer, vae=self.vae, scheduler=scheduler, id2label=self.id2label)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def validate(self, model: nn.Module, step: int) -> None:
        from .validation import write_dit_samples

        o = self.options
        write_dit_samples(
            self._pipeline(model),
            o.validation_classes,
            o.output_dir,
            step,
            num_inference_steps=o.validation_num_inference_steps,
            guidance_scale=o.validation_guidance_scale,
            seed=o.validation_seed,
        )

    def fid_samples(self, model: nn.Module, indices: list[int]):
        """Validation-FID images ``indices`` (uint8 ``(n, H, W, 3)``): classes i.i.d. uniform over the model's
        classes, sample ``i`` seeded by ``(validation_seed, i)`` (as ``mhla eval-sample``)."""
        import numpy as np

        from ..eval.sample import class_labels, sample_seed, to_uint8

        o = self.options
        labels = class_labels(o.validation_fid_samples, self.num_classes, "uniform", o.validation_seed)
        pipe = self._pipeline(model)
        images = []
        for start in range(0, len(indices), o.validation_fid_batch_size):
            batch = indices[start : start + o.validation_fid_batch_size]
            generators = [torch.Generator("cpu").manual_seed(sample_seed(o.validation_seed, i)) for i in batch]
            output = pipe(
                labels[batch].tolist(),
                guidance_scale=o.validation_guidance_scale,
                generator=generators,
                num_inference_steps=o.validation_num_inference_steps,
                output_type="np",
            )
            images.append(to_uint8(output.images))
        return np.concatenate(images)

    def save_pipeline(self, model: nn.Module) -> None:
        """``<output_dir>/pipeline``, recording as its generation defaults the guidance of the validation samples and
        the steps of ``pretrained_model`` (Diffusers' 50 for a DiT trained from scratch)."""
        from ..utils.model_defaults import image_defaults

        o = self.options
        folder = Path(o.output_dir) / "pipeline"
        with unshared_embedders(model):
            pipe = self._pipeline(model)
            pipe.record_generation_defaults(
                guidance_scale=o.validation_guidance_scale,
                num_inference_steps=image_defaults(o.pretrained_model).steps,
            )
            pipe.save_pretrained(folder)
        logger.info("saved pipeline %s", folder)


def train(options: DiTTrainOptions, on_step_end=None) -> Path:
    """Run the class-to-image trainer; returns the final output folder."""
    return run_task(DiTTask(options), on_step_end=on_step_end)


def main(argv: Sequence[str] | None = None) -> int:
    from .entry import main as trainer_main

    return trainer_main("dit", argv)


if __name__ == "__main__":
    sys.exit(main())
