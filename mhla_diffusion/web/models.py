"""Loading, caching and running the demo's pipelines (MHLA, and softmax for "compare").

Pipelines load once (with :func:`mhla_diffusion.loaders.loading.load_pipeline`, as the CLI loads them) and
are kept. Each task has one lock: the MHLA pipeline and its softmax counterpart may share components
(text encoder, VAE), so one task runs one generation at a time whatever the queue's concurrency.

A click generates several samples in one batch, sample ``i`` from its own seed (``seed + i``), so each
is what that seed alone gives. The denoising loop is timed alone: each step ends with a timestamp
(``callback_on_step_end``), the first step is the warm-up, and :attr:`Generated.step_seconds` is the
median of the others. For an embedded model the judge reads every sample
(:mod:`mhla_diffusion.embedded.judges.judge_reading`).

The "Long video" task (``"long-video"``) streams one video chunk by chunk with
:class:`~mhla_diffusion.pipelines.wan_streaming.MHLAWanStreamingPipeline` (:meth:`ModelStore.stream_video`).
"""

from __future__ import annotations

import copy
import math
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from ..loaders.loading import hub_errors
from ..utils.choices import Attention
from .config import DemoConfig, TaskModels
from .validation import DemoInputError, ImageRequest, LongVideoRequest, VideoRequest

__all__ = ["Generated", "GenerationStopped", "ModelStore"]

#: ``progress(step, total)`` after each denoising step (``step`` counts from 1).
StepProgress = Callable[[int, int], None]


class GenerationStopped(Exception):
    """The user pressed stop: the generation ended after denoising step ``step`` of ``total``."""

    def __init__(self, step: int, total: int):
        super().__init__(f"stopped after denoising step {step} of {total}")
        self.step, self.total = step, total


@dataclass(frozen=True)
class Generated:
    """One click's samples with one attention: videos ``(F, H, W, 3)`` or images ``(H, W, 3)``, floats in [0, 1].

    ``seconds``: end to end (text encoder, denoising loop, VAE decode); ``step_ends``: when each denoising
    step ended (``time.perf_counter``); ``readings``: the judge's reading of each sample (``None`` entries
    without a judge), ``judge_note`` why there is none when the model has a judge; ``tokens``: what the
    model's self-attention sees per sample.
    """

    arrays: list[np.ndarray]
    seeds: list[int]
    seconds: float
    attention: Attention
    step_ends: list[float] = field(default_factory=list)
    readings: list[Any] = field(default_factory=list)
    judge_note: str | None = None
    #: Tokens the model's self-attention sees per sample (for the speed context beside the timings).
    tokens: int | None = None

    @property
    def step_seconds(self) -> float | None:
        """Median seconds of one denoising step after the first (the warm-up); ``None`` with fewer than 2 steps."""
        durations = np.diff(self.step_ends)
        return float(statistics.median(durations.tolist())) if len(durations) else None


class ModelStore:
    """The demo's pipelines, loaded on first use (or by :meth:`preload`) and reused."""

    def __init__(self, config: DemoConfig):
        self.config = config
        self._pipes: dict[tuple[str, str], Any] = {}
        self._plans: dict[str, Any] = {}  # one load plan per task (_load_plan)
        self._locks = {task: threading.RLock() for task in ("text-to-video", "class-to-image", "long-video")}
        self._device_dtype: tuple[str, Any] | None = None
        self._readers: dict[str, Any] = {}
        self._tokenizers: dict[str, Any] = {}  # a copy of each video task's tokenizer for prompt checks meanwhile
        self._tokenizer_lock = threading.Lock()

    # ------------------------------------------------------------ loading

    @property
    def device_and_dtype(self) -> tuple[str, Any]:
        if self._device_dtype is None:
            from ..loaders.loading import device_and_dtype

            self._device_dtype = device_and_dtype(self.config.device, self.config.dtype)
        return self._device_dtype

    def _models(self, task: str) -> TaskModels:
        return self.config.video if task == "text-to-video" else self.config.image

    def _model_names(self, task: str) -> dict[str, str]:
        """``{model id: flag}`` of ``task``'s models, for the line about one the hub cannot give."""
        if task == "long-video":
            return {self._long_model(): "--long-model"}
        flag = "--t2v" if task == "text-to-video" else "--c2i"
        models = self._models(task)
        return {
            m: f"{flag}-{name}" for name, m in (("model", models.model), ("softmax-model", models.softmax_model)) if m
        }

    def _long_model(self) -> str:
        """The long-video model folder; ``ValueError`` with the page's line when there is none."""
        long_video = self.config.long_video
        if long_video is None or long_video.model is None:
            raise ValueError(long_video.missing if long_video is not None else "this demo has no long-video model")
        return long_video.model

    def _pipeline_class(self, task: str) -> type:
        if task == "long-video":
            from ..pipelines.wan_streaming import MHLAWanStreamingPipeline

            return MHLAWanStreamingPipeline
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
                with hub_errors(self._model_names(task)):  # a model the hub cannot give: one line for the page
                    self._pipes[key] = self._load(task, attention)
            return self._pipes[key]

    def _load_plan(self, task: str) -> Any:
        """``task``'s :class:`~mhla_diffusion.loaders.plan.PipelinePlan` (its model, MHLA weights and transformer),
        resolved on first use and kept: the MHLA load and the softmax base load both read it."""
        if task not in self._plans:
            from ..loaders.plan import plan_pipeline

            _, dtype = self.device_and_dtype
            if task == "long-video":
                self._plans[task] = plan_pipeline(self._long_model(), dtype=dtype)
            else:
                models = self._models(task)
                self._plans[task] = plan_pipeline(
                    models.model, models.mhla_weights, None, models.transformer, dtype=dtype
                )
        return self._plans[task]

    def _load(self, task: str, attention: Attention) -> Any:
        import torch

        from ..loaders.loading import load_pipeline
        from ..loaders.weights import load_transformer

        cls = self._pipeline_class(task)
        device, dtype = self.device_and_dtype
        component_dtypes = {"vae": torch.float32} if task != "class-to-image" else None
        if task == "long-video":
            pipe = load_pipeline(
                cls, self._load_plan(task), attention="mhla", dtype=dtype, component_dtypes=component_dtypes
            )
            pipe.set_progress_bar_config(disable=True)
            return pipe.to(device)
        models = self._models(task)
        if attention == "mhla":
            pipe = load_pipeline(
                cls, self._load_plan(task), attention="mhla", dtype=dtype, component_dtypes=component_dtypes
            )
        elif models.softmax_source == "folder":
            pipe = load_pipeline(
                cls, models.softmax_model, attention="softmax", dtype=dtype, component_dtypes=component_dtypes
            )
        elif models.softmax_source == "base":
            mhla_pipe = self.pipeline(task, "mhla")
            components = dict(mhla_pipe.components)
            components["transformer"] = load_transformer(self._load_plan(task).model, dtype=dtype)
            # its own scheduler: schedulers keep per-run state
            components["scheduler"] = type(mhla_pipe.scheduler).from_config(mhla_pipe.scheduler.config)
            pipe = cls(**components)
        else:
            return self.pipeline(task, "mhla")  # the same weights, run with softmax_attention()
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(device)

    def preload(self) -> None:
        """Load the MHLA pipelines now (the softmax ones load on the first "compare"), the long-video one when
        there is one."""
        for task in ("text-to-video", "class-to-image"):
            self.pipeline(task, "mhla")
        if self.config.long_video is not None and self.config.long_video.model is not None:
            self.pipeline("long-video", "mhla")

    @staticmethod
    def attention_context(pipe: Any, attention: Attention):
        """``softmax_attention()`` for the softmax side of a pipeline that has MHLA layers, else nothing."""
        if attention == "softmax" and getattr(pipe, "mhla", None) is not None:
            return pipe.softmax_attention()
        return nullcontext()

    # ------------------------------------------------------------ class names

    def class_labels(self) -> tuple[dict[str, int], int]:
        """``(name -> id, number of classes)`` of the class-to-image model, read without loading when local."""
        from ..loaders.loading import local_labels
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

    # ------------------------------------------------------------ prompt words and the judges

    def unknown_words(self, prompt: str, task: str = "text-to-video") -> list[str]:
        """The words of ``prompt`` the ``task`` model's tokenizer ("text-to-video" or "long-video") does not know
        (see the pipelines' ``unknown_words``). Uses its own copy of the tokenizer, so it answers while a
        generation runs."""
        with self._tokenizer_lock:
            if task not in self._tokenizers:
                pipe = self.pipeline(task, "mhla")
                # the pipeline's own rule, on a copy of its tokenizer (a fast tokenizer is not to be shared by threads)
                holder = SimpleNamespace(tokenizer=copy.deepcopy(pipe.tokenizer))
                self._tokenizers[task] = (type(pipe).unknown_words, holder)
            rule, holder = self._tokenizers[task]
            return rule(holder, prompt)

    def judge(self, task: str) -> Any:
        """The ``JudgeReader`` for ``task``'s samples when its model is an embedded model, else ``None``."""
        from ..embedded.locations import embedded_folder

        with self._locks[task]:
            if task not in self._readers:
                folder = embedded_folder(self._models(task).model)
                reader = None
                if folder is not None:
                    from ..embedded.judges.judge_reading import JudgeReader

                    reader = JudgeReader(folder.judge())
                self._readers[task] = reader
            return self._readers[task]

    # ------------------------------------------------------------ generation

    @staticmethod
    def _step_callback(progress: StepProgress | None, total: int, step_ends: list[float], stop: threading.Event | None):
        """``callback_on_step_end``: timestamps each step's end, reports progress, and stops when ``stop`` is set."""

        def on_step_end(pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            step_ends.append(time.perf_counter())
            if progress is not None:
                progress(step + 1, total)
            if stop is not None and stop.is_set():
                raise GenerationStopped(step + 1, total)
            return callback_kwargs

        return on_step_end

    def generate_video(
        self,
        request: VideoRequest,
        attention: Attention = "mhla",
        progress: StepProgress | None = None,
        stop: threading.Event | None = None,
    ) -> Generated:
        """Generate ``request.samples`` videos (seeds ``request.seeds``) in one batch, and the judge's readings.

        A size the MHLA block layout cannot run on is a :class:`DemoInputError`; ``stop`` set during the loop
        ends it with :class:`GenerationStopped`.
        """
        import torch

        task = "text-to-video"
        with self._locks[task]:
            pipe = self.pipeline(task, attention)
            if attention == "mhla":
                try:
                    pipe.check_mhla_size(request.num_frames, request.height, request.width)
                except ValueError as error:
                    raise DemoInputError(str(error)) from None
            step_ends: list[float] = []
            started = time.perf_counter()
            with self.attention_context(pipe, attention), torch.inference_mode():
                frames = pipe(
                    prompt=request.prompt,
                    negative_prompt=request.negative_prompt,
                    num_frames=request.num_frames,
                    height=request.height,
                    width=request.width,
                    num_inference_steps=request.steps,
                    guidance_scale=request.guidance_scale,
                    num_videos_per_prompt=request.samples,
                    generator=[torch.Generator("cpu").manual_seed(seed) for seed in request.seeds],
                    max_sequence_length=self.config.max_sequence_length,
                    output_type="np",
                    callback_on_step_end=self._step_callback(progress, request.steps, step_ends, stop),
                ).frames
            seconds = time.perf_counter() - started
            videos = [np.asarray(video) for video in frames]
            readings, note = self._read(
                task, videos, lambda reader: reader.read_videos(np.stack(videos), [request.prompt] * len(videos))
            )
            tokens = math.prod(pipe.token_grid(request.num_frames, request.height, request.width))
            return Generated(videos, request.seeds, seconds, attention, step_ends, readings, note, tokens)

    def stream_video(
        self,
        request: LongVideoRequest,
        on_frames: Callable[[np.ndarray], None],
        progress: StepProgress | None = None,
        stop: threading.Event | None = None,
        abandon: threading.Event | None = None,
    ) -> None:
        """Stream one long video: ``on_frames(frames)`` gets each chunk's frames ``(F_chunk, H, W, 3)`` (floats in
        [0, 1]) as soon as they are decoded; ``progress(step, total)`` counts the steps of every chunk.

        ``stop`` set: the video ends after the chunk being denoised, which is finished, decoded and delivered
        first (the pipeline's ``interrupt`` at that chunk's last step). ``abandon`` set (nobody is watching any
        more): :class:`GenerationStopped` at the next step, nothing more delivered. A size the model cannot stream
        is a :class:`DemoInputError`.
        """
        import torch

        task = "long-video"
        chunks = request.chunks
        total = chunks.num_chunks * request.steps
        with self._locks[task]:
            pipe = self.pipeline(task, "mhla")
            try:
                pipe.check_stream(request.num_frames, request.height, request.width, chunks.chunk_frames)
            except ValueError as error:
                raise DemoInputError(str(error)) from None

            def on_step_end(pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
                done = pipe.current_chunk * request.steps + step + 1
                if progress is not None:
                    progress(done, total)
                if abandon is not None and abandon.is_set():
                    raise GenerationStopped(done, total)
                if stop is not None and stop.is_set() and step + 1 == pipe.num_timesteps:
                    pipe._interrupt = True  # this chunk is decoded and delivered, and the video ends there
                return callback_kwargs

            with torch.inference_mode():
                pipe(
                    prompt=request.prompt,
                    negative_prompt=request.negative_prompt,
                    num_frames=request.num_frames,
                    height=request.height,
                    width=request.width,
                    chunk_frames=chunks.chunk_frames,
                    num_inference_steps=request.steps,
                    guidance_scale=request.guidance_scale,
                    generator=torch.Generator("cpu").manual_seed(request.seed),
                    max_sequence_length=self.config.long_video.max_sequence_length,
                    output_type="np",
                    on_frames=lambda frames: on_frames(np.asarray(frames[0])),
                    return_frames=False,
                    callback_on_step_end=on_step_end,
                )

    def generate_image(
        self,
        request: ImageRequest,
        attention: Attention = "mhla",
        progress: StepProgress | None = None,
        stop: threading.Event | None = None,
    ) -> Generated:
        """Generate ``request.samples`` class-conditional images (seeds ``request.seeds``) in one batch."""
        import torch

        task = "class-to-image"
        with self._locks[task]:
            pipe = self.pipeline(task, attention)
            step_ends: list[float] = []
            started = time.perf_counter()
            with self.attention_context(pipe, attention), torch.inference_mode():
                images = pipe(
                    class_labels=[request.class_id] * request.samples,
                    guidance_scale=request.guidance_scale,
                    num_inference_steps=request.steps,
                    generator=[torch.Generator("cpu").manual_seed(seed) for seed in request.seeds],
                    output_type="np",
                    callback_on_step_end=self._step_callback(progress, request.steps, step_ends, stop),
                ).images
            seconds = time.perf_counter() - started
            arrays = [np.asarray(image) for image in images]
            readings, note = self._read(
                task, arrays, lambda reader: reader.read_images(np.stack(arrays), [request.class_id] * len(arrays))
            )
            config = pipe.transformer.config
            tokens = (config.sample_size // config.patch_size) ** 2
            return Generated(arrays, request.seeds, seconds, attention, step_ends, readings, note, tokens)

    def _read(
        self, task: str, samples: list[np.ndarray], read: Callable[[Any], list[Any]]
    ) -> tuple[list[Any], str | None]:
        """The judge's readings of ``samples`` (``read(reader)``), or ``None`` each with why (``None``: no judge)."""
        reader = self.judge(task)
        if reader is None:
            return [None] * len(samples), None
        why = reader.unreadable(samples[0].shape)
        if why is not None:
            return [None] * len(samples), why
        return read(reader), None
