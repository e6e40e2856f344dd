"""Class-to-image: Diffusers' ``DiTPipeline`` with MHLA self-attention."""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Sequence, Union

import torch
from diffusers import AutoencoderKL, DiTPipeline, DiTTransformer2DModel
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.schedulers import KarrasDiffusionSchedulers

from .class_labels import label_index, resolve_class_ids
from .mhla_mixin import MHLAPipelineMixin

__all__ = ["MHLADiTPipeline", "STOCK_NULL_CLASS", "label_index", "resolve_class_ids"]

#: The class Diffusers' stock ``DiTPipeline`` gives the unconditional half of a guided batch (ImageNet's null class).
STOCK_NULL_CLASS = 1000


class MHLADiTPipeline(MHLAPipelineMixin, DiTPipeline):
    """``DiTPipeline`` whose transformer may use MHLA (see :class:`MHLAPipelineMixin`).

    Beyond the stock pipeline: classes may be given by name or id, ``id2label`` survives
    ``save_pretrained``, guidance uses the model's own null class (``num_embeds_ada_norm``; the stock
    pipeline assumes ImageNet's 1000), and ``callback_on_step_end`` is supported with Diffusers' callback
    contract: called after every scheduler step with the tensors of ``_callback_tensor_inputs`` it asks for
    (``latents``; with guidance they hold both CFG halves, as DiT keeps them), beside the pipeline properties
    ``guidance_scale``, ``do_classifier_free_guidance`` and ``num_timesteps``. (The stock sampling loop reads
    the guidance scale it was called with: a callback that changes ``pipe._guidance_scale`` changes the
    property, not the run.)
    """

    _callback_tensor_inputs = ["latents"]

    _stock_pipeline_name = "DiTPipeline"
    _stock_transformer_name = "DiTTransformer2DModel"
    _mhla_transformer_name = "MHLADiTTransformer2DModel"
    _generates_video = False

    def __init__(
        self,
        transformer: DiTTransformer2DModel,
        vae: AutoencoderKL,
        scheduler: KarrasDiffusionSchedulers,
        id2label: dict[Union[int, str], str] | None = None,  # str keys: as model_index.json gives them back
    ):
        super().__init__(transformer=transformer, vae=vae, scheduler=scheduler, id2label=id2label)
        if id2label is not None:  # stock DiTPipeline forgets it on save
            self.register_to_config(id2label={int(k): v for k, v in id2label.items()})

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """:meth:`MHLAPipelineMixin.save_pretrained`, warning when Diffusers' stock ``DiTPipeline`` cannot guide the
        saved model: it labels the unconditional half class 1000 (ImageNet's null class), and a model with
        another class count (e.g. trained from scratch with ``num_classes: data``) has its null class elsewhere."""
        super().save_pretrained(save_directory, **kwargs)
        null = int(self.transformer.config.num_embeds_ada_norm)
        if null != STOCK_NULL_CLASS:
            warnings.warn(
                f"{save_directory} holds a DiT with {null} classes (null class {null}): Diffusers' stock DiTPipeline "
                f"guides with class {STOCK_NULL_CLASS} as the null class, so it runs this folder only with "
                "guidance_scale <= 1 "
                f"(with guidance it {'fails with IndexError' if null < STOCK_NULL_CLASS else 'guides wrongly'}); "
                "load it with mhla_diffusion.MHLADiTPipeline, which guides with the model's own null class",
                stacklevel=2,
            )

    def _with_null_class(self, call: Callable[[], Any], guided: bool) -> Any:
        """Run ``call`` so that the unconditional half of a guided batch gets this model's null class.

        The stock ``DiTPipeline`` labels that half 1000, ImageNet's null class; a model with
        ``num_embeds_ada_norm`` other than 1000 keeps its null class at ``num_embeds_ada_norm``.
        """
        null = int(self.transformer.config.num_embeds_ada_norm)
        if not guided or null == STOCK_NULL_CLASS:
            return call()

        def relabel(module, args, kwargs):
            labels = kwargs.get("class_labels")
            if labels is not None:
                labels = labels.clone()
                labels[labels.shape[0] // 2 :] = null
                kwargs["class_labels"] = labels
            return args, kwargs

        handle = self.transformer.register_forward_pre_hook(relabel, with_kwargs=True)
        try:
            return call()
        finally:
            handle.remove()

    @property
    def guidance_scale(self) -> float:
        """The guidance scale of the current (or last) call."""
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Whether the current (or last) call guides: ``guidance_scale > 1``, as ``DiTPipeline`` decides."""
        return self._guidance_scale > 1

    @property
    def num_timesteps(self) -> int:
        """The number of denoising steps of the current (or last) call (the scheduler's timesteps)."""
        return self._num_timesteps

    def class_ids(self, classes: int | str | Sequence[int | str]) -> list[int]:
        """Class ids for ids and/or label names; unknown names or ids are a ``ValueError``."""
        return resolve_class_ids(classes, self.labels, int(self.transformer.config.num_embeds_ada_norm))

    def __call__(
        self,
        class_labels: int | str | Sequence[int | str],
        guidance_scale: float = 4.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        num_inference_steps: int = 50,
        output_type: str | None = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable[..., dict[str, Any]] | PipelineCallback | MultiPipelineCallbacks | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ):
        """Generate one image per class label (an id or a name; nested lists and tensors of ids as in ``DiTPipeline``).
        Other arguments as ``DiTPipeline.__call__``; ``callback_on_step_end`` as in Diffusers' other pipelines."""
        labels = self.class_ids(class_labels)
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        unknown = [name for name in callback_on_step_end_tensor_inputs if name not in self._callback_tensor_inputs]
        if callback_on_step_end is not None and unknown:
            raise ValueError(
                f"callback_on_step_end_tensor_inputs {unknown} are not among this pipeline's "
                f"{self._callback_tensor_inputs}"
            )
        self._guidance_scale, self._num_timesteps = guidance_scale, num_inference_steps
        stock_call = lambda: super(MHLADiTPipeline, self).__call__(  # noqa: E731
            labels, guidance_scale, generator, num_inference_steps, output_type, return_dict
        )
        call = lambda: self._with_null_class(stock_call, guidance_scale > 1)  # noqa: E731
        scheduler_step = self.scheduler.step
        step_index = [0]

        def step_with_callback(model_output, timestep, sample, *args, **kwargs):
            self._num_timesteps = len(self.scheduler.timesteps)
            out = scheduler_step(model_output, timestep, sample, *args, **kwargs)
            if callback_on_step_end is not None:
                given = {"latents": out.prev_sample} if "latents" in callback_on_step_end_tensor_inputs else {}
                result = callback_on_step_end(self, step_index[0], timestep, given)
                if result and "latents" in result:
                    out.prev_sample = result["latents"]
            step_index[0] += 1
            return out

        self.scheduler.step = step_with_callback  # the stock loop calls self.scheduler.step once per step
        try:
            return call()
        finally:
            del self.scheduler.step
