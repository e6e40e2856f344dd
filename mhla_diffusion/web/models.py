"""Loading, caching and running the demo's pipelines (MHLA, and softmax for "compare").

Pipelines load once (with :func:`mhla_diffusion.loading.load_pipeline`, as the CLI loads them) and
are kept. Each task has one lock: the MHLA pipeline and its softmax counterpart may share components
(text encoder, VAE), so one task runs one generation at a time whatever the queue's concurrency.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np

from .config import DemoConfig, TaskModels
from .validation import DemoInputError, ImageRequest, VideoRequest

__all__ = ["Generated", "ModelStore"]

Attention = Literal["mhla", "softmax"]
#: ``progress(step, total)`` after each denoising step (``step`` counts from 1).
StepProgress = Callable[[int, int], None]


@dataclass(frozen=True)
class Generated:
    """One output: a video ``(F, H, W, 3)`` or an image ``(H, W, 3)``, floats in [0, 1], and its wall time."""

    array: np.ndarray
    seconds: float
    attention: Attention


class ModelStore:
    """The demo's pipelines, loaded on first use (or by :meth:`preload`) and reused."""

    def __init__(self, config: DemoConfig):
        self.config = config
        self._pipes: dict[tuple[str, str], Any] = {}
        self._locks = {"text-to-video": threading.RLock(), "class-to-image": threading.RLock()}
        self._device_dtype: tuple[str, Any] | None = None

    # ------------------------------------------------------------ loading

    @property
    def device_and_dtype(self) -> tuple[str, Any]:
        if self._device_dtype is None:
            from ..loading import device_and_dtype

            self._device_dtype = device_and_dtype(self.config.device, self.config.dtype)
        return self._device_dtype

    def _models(self, task: str) -> TaskModels:
        return self.config.video if task == "text-to-video" else self.config.image

    def _pipeline_class(self, task: str) -> type:
        if task == "text-to-video":
            from ..pipelines.wan import MHLAWanPipeline

            return MHLAWanPipeline
        from ..pipelines.dit import MHLADiTPipeline

        return MHLADiTPipeline

    def pipeline(self, task: str, attention: Attention = "mhla") -> Any:
        """The loaded pipeline for ``task``; for ``softmax`` run it inside :meth:`attention_context`."""
        key = (task, attention)
        with self._locks[task]:
            if key not in self._pipes:
                self._pipes[key] = self._load(task, attention)
            return self._pipes[key]

    def _load(self, task: str, attention: Attention) -> Any:
        import torch

        from ..loading import load_pipeline
        from ..weights import load_transformer

        models = self._models(task)
        cls = self._pipeline_class(task)
        device, dtype = self.device_and_dtype
        component_dtypes = {"vae": torch.float32} if task == "text-to-video" else None
        if attention == "mhla":
            pipe = load_pipeline(cls, models.model, mhla_weights=models.mhla_weights, transformer=models.transformer,
                                 attention="mhla", dtype=dtype, component_dtypes=component_dtypes)
        elif models.softmax_source == "folder":
            pipe = load_pipeline(cls, models.softmax_model, attention="softmax", dtype=dtype, component_dtypes=component_dtypes)
        elif models.softmax_source == "base":
            mhla_pipe = self.pipeline(task, "mhla")
            components = dict(mhla_pipe.components)
            components["transformer"] = load_transformer(models.model, dtype=dtype)
            # its own scheduler: schedulers keep per-run state
            components["scheduler"] = type(mhla_pipe.scheduler).from_config(mhla_pipe.scheduler.config)
            pipe = cls(**components)
        else:
            return self.pipeline(task, "mhla")  # the same weights, run with softmax_attention()
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(device)

    def preload(self) -> None:
        """Load both MHLA pipelines now (the softmax ones load on the first "compare")."""
        for task in ("text-to-video", "class-to-image"):
            self.pipeline(task, "mhla")

    @staticmethod
    def attention_context(pipe: Any, attention: Attention):
        """``softmax_attention()`` for the softmax side of a pipeline that has MHLA layers, else nothing."""
        if attention == "softmax" and getattr(pipe, "mhla", None) is not None:
            return pipe.softmax_attention()
        return nullcontext()

    # ------------------------------------------------------------ class names

    def class_labels(self) -> tuple[dict[str, int], int]:
        """``(name -> id, number of classes)`` of the class-to-image model, read without loading when local."""
        from ..loading import local_labels
        from ..pipelines.class_labels import label_index

        local = local_labels(self.config.image.model)
        if local is not None:
            return local
        pipe = self.pipeline("class-to-image", "mhla")
        labels = label_index(pipe.config.get("id2label")) or dict(pipe.labels)
        return labels, int(pipe.transformer.config.num_embeds_ada_norm)

    def class_choices(self) -> list[str]:
        """One name per class id (its first synonym), in id order, for the class menu."""
        labels, _ = self.class_labels()
        first: dict[int, str] = {}
        for name, class_id in labels.items():
            first.setdefault(class_id, name)
        return [first[i] for i in sorted(first)]

    # ------------------------------------------------------------ generation

    @staticmethod
    def _step_callback(progress: StepProgress | None, total: int):
        if progress is None:
            return None

        def on_step_end(pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            progress(step + 1, total)
            return callback_kwargs

        return on_step_end

    def generate_video(self, request: VideoRequest, attention: Attention = "mhla",
                       progress: StepProgress | None = None) -> Generated:
        """Generate one video; a size the MHLA block layout cannot run on is a :class:`DemoInputError`."""
        import torch

        task = "text-to-video"
        with self._locks[task]:
            pipe = self.pipeline(task, attention)
            if attention == "mhla":
                try:
                    pipe.check_mhla_size(request.num_frames, request.height, request.width)
                except ValueError as error:
                    raise DemoInputError(str(error)) from None
            started = time.perf_counter()
            with self.attention_context(pipe, attention), torch.inference_mode():
                frames = pipe(
                    prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                    height=request.height, width=request.width, num_inference_steps=request.steps,
                    guidance_scale=request.guidance_scale, generator=torch.Generator("cpu").manual_seed(request.seed),
                    max_sequence_length=self.config.max_sequence_length, output_type="np",
                    callback_on_step_end=self._step_callback(progress, request.steps),
                ).frames[0]
            return Generated(np.asarray(frames), time.perf_counter() - started, attention)

    def generate_image(self, request: ImageRequest, attention: Attention = "mhla",
                       progress: StepProgress | None = None) -> Generated:
        """Generate one class-conditional image."""
        import torch

        task = "class-to-image"
        with self._locks[task]:
            pipe = self.pipeline(task, attention)
            started = time.perf_counter()
            with self.attention_context(pipe, attention), torch.inference_mode():
                images = pipe(
                    class_labels=[request.class_id], guidance_scale=request.guidance_scale,
                    num_inference_steps=request.steps, generator=torch.Generator("cpu").manual_seed(request.seed),
                    output_type="np", callback_on_step_end=self._step_callback(progress, request.steps),
                ).images
            return Generated(np.asarray(images[0]), time.perf_counter() - started, attention)
