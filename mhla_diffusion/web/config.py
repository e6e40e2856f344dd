"""The web demo's settings: command-line flags, each with an environment variable as its default.

Models default to the embedded demonstration models (:mod:`mhla_diffusion.embedded`). For each task
the "compare" option needs a softmax model; where it comes from (see :func:`resolve_task_models`):

* ``--t2v-softmax-model`` / ``--c2i-softmax-model`` given: that pipeline folder, run with softmax attention;
* the embedded default: the embedded softmax teacher the MHLA model was converted from;
* ``--*-model`` plus ``--*-mhla-weights`` or ``--*-transformer``: the base model's own transformer, as is
  (text encoder, VAE and tokenizer shared with the MHLA pipeline);
* a ``--*-model`` that already holds MHLA (a folder saved by our pipelines): the same weights run
  with the original softmax attention (``softmax_attention()``).

The form's defaults (frames, size, steps, guidance, frame rate, text length) are the models' own
(:mod:`mhla_diffusion.utils.model_defaults`) unless a flag gives them.

The "Long video" tab streams one video chunk by chunk from a block-causal MHLA pipeline (see
:func:`resolve_long_video`): ``--long-model``, by default the embedded long-video model. Its form starts at
:data:`LONG_VIDEO_FRAMES` frames (``--long-num-frames``) and takes the rest (size, steps, guidance, frame rate, text
length, and the latent frames per chunk it trained with) from that model as the other tabs do. Without the embedded
model (not built yet) and without ``--long-model`` the tab says how to get one and the other tabs work as usual.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from ..cli.arguments import parse_device
from ..embedded import embedded_defaults, embedded_model
from ..embedded.worlds.bouncing_shapes import BOUNCE_FRAMES
from ..loaders.loading import DIT_HUB_ID, WAN_HUB_ID, check_model_source
from ..utils.choices import WEIGHT_DTYPES
from ..utils.geometry import WAN_PIPELINE_SIZE_MULTIPLE, VideoGeometry
from ..utils.model_defaults import RECORD_KEY, image_defaults, video_defaults
from ..utils.options import at_least, between, number, state_ranges
from ..utils.stream_frames import stream_chunks
from .validation import Limits

__all__ = [
    "LONG_VIDEO_FRAMES",
    "DemoConfig",
    "LongVideo",
    "TaskModels",
    "add_arguments",
    "config_from_args",
    "resolve_long_video",
    "resolve_task_models",
]

SoftmaxSource = Literal["folder", "base", "same"]
ENV_PREFIX = "MHLA_DEMO_"
#: The demo's number flags: each reads its text, and its environment variable, with its valid range.
PORT = number(int, between(1, 65535))
COUNT = number(int, at_least(1))
GUIDANCE = number(float, between(0, Limits.max_guidance))
SAMPLES = number(int, between(1, Limits.max_samples))
SIZE_LIMIT = number(int, at_least(WAN_PIPELINE_SIZE_MULTIPLE))
#: The long-video form's frames: 8x the clips the embedded long-video model trains on (17 frames -> 129).
LONG_VIDEO_FRAMES = 1 + 8 * (BOUNCE_FRAMES - 1)


@dataclass(frozen=True)
class TaskModels:
    """Where one task's MHLA model and its softmax counterpart come from."""

    task: Literal["text-to-video", "class-to-image"]
    model: str
    mhla_weights: Path | None = None
    transformer: Path | None = None
    softmax_model: str | None = None
    softmax_source: SoftmaxSource = "same"

    def describe(self) -> str:
        """One line for the page (folder names, not whole paths)."""

        def short(path: str | Path) -> str:
            return Path(path).name or str(path)

        extra = "".join(
            f" + {name} {short(value)}"
            for name, value in (("MHLA weights", self.mhla_weights), ("transformer", self.transformer))
            if value
        )
        softmax = {
            "folder": f"softmax model {short(self.softmax_model or '')}",
            "base": "softmax: the base model as is",
            "same": "softmax: the same weights with the original attention",
        }[self.softmax_source]
        return f"{short(self.model)}{extra}; {softmax}"


@dataclass(frozen=True)
class UIDefaults:
    """Values the form starts with."""

    num_frames: int
    height: int
    width: int
    fps: int
    video_steps: int
    video_guidance_scale: float
    image_steps: int
    image_guidance_scale: float
    negative_prompt: str = ""
    prompt: str = "a red circle moving right"
    samples: int = 4


@dataclass(frozen=True)
class LongVideo:
    """The "Long video" tab: its block-causal MHLA pipeline and the values its form starts with.

    ``model`` is ``None`` when there is none (``missing``: why, and how to get one): the tab then shows that line.
    """

    model: str | None
    num_frames: int
    height: int
    width: int
    steps: int
    guidance_scale: float
    fps: int
    max_sequence_length: int
    missing: str | None = None
    #: Latent frames per chunk: the model's recorded ``chunk_frames`` (what it trained with); ``None``: the rule's.
    chunk_frames: int | None = None


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo needs to start."""

    video: TaskModels
    image: TaskModels
    defaults: UIDefaults
    limits: Limits = field(default_factory=Limits)
    device: str | None = None
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    concurrency: int = 1
    max_queue: int = 16
    preload: bool = True
    max_sequence_length: int = 512  # text tokens; the embedded model was trained with 16
    long_video: LongVideo | None = None  # None: no "Long video" tab


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + name, default) or default


def _env_number(name: str, parse: Callable[[str], Any], default: Any) -> Any:
    """Environment variable ``MHLA_DEMO_<name>`` read by the flag's own type ``parse`` (its range included), or
    ``default`` when unset."""
    value = _env(name)
    if value is None:
        return default
    try:
        return parse(value)
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"environment variable {ENV_PREFIX}{name}: {error}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags (shared by ``python app.py`` and ``mhla web``)."""
    d = embedded_defaults()
    for prefix, task, env, example in (
        ("t2v", "text-to-video", "T2V", WAN_HUB_ID),
        ("c2i", "class-to-image", "C2I", DIT_HUB_ID),
    ):
        group = parser.add_argument_group(f"{task} model (default: the embedded {task} models)")
        group.add_argument(
            f"--{prefix}-model",
            default=_env(f"{env}_MODEL"),
            help=f"Diffusers pipeline folder or hub id, e.g. {example} (env {ENV_PREFIX}{env}_MODEL)",
        )
        group.add_argument(
            f"--{prefix}-mhla-weights",
            type=Path,
            default=_env(f"{env}_MHLA_WEIGHTS"),
            help=f"MHLA weights folder (save_mhla / `mhla convert --output`) (env {ENV_PREFIX}{env}_MHLA_WEIGHTS)",
        )
        group.add_argument(
            f"--{prefix}-transformer",
            type=Path,
            default=_env(f"{env}_TRANSFORMER"),
            help=f"converted transformer folder or original-format checkpoint (env {ENV_PREFIX}{env}_TRANSFORMER)",
        )
        group.add_argument(
            f"--{prefix}-softmax-model",
            default=_env(f"{env}_SOFTMAX_MODEL"),
            help="pipeline folder for the softmax side of 'compare' (default: see docs/web.md) "
            f"(env {ENV_PREFIX}{env}_SOFTMAX_MODEL)",
        )
    long = parser.add_argument_group("long-video model (default: the embedded long-video model)")
    long.add_argument(
        "--long-model",
        default=_env("LONG_MODEL"),
        help="pipeline folder of a block-causal MHLA model (MHLAConfig(causal=True), saved by our pipelines) for "
        f"the Long video tab (env {ENV_PREFIX}LONG_MODEL)",
    )
    long.add_argument(
        "--long-num-frames",
        type=COUNT,
        default=_env_number("LONG_NUM_FRAMES", COUNT, None),
        help=f"frames of the Long video form (default {LONG_VIDEO_FRAMES}: 8x the embedded long-video model's "
        f"{BOUNCE_FRAMES}-frame training clips)",
    )
    run = parser.add_argument_group("server and device")
    run.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to serve on (default 127.0.0.1)")
    run.add_argument(
        "--port", type=PORT, default=_env_number("PORT", PORT, None), help="port (default: 7860 or the next free one)"
    )
    run.add_argument(
        "--concurrency",
        type=COUNT,
        default=_env_number("CONCURRENCY", COUNT, 1),
        help="generations run at once, all tabs together (default 1); others wait in the queue",
    )
    run.add_argument(
        "--max-queue",
        type=COUNT,
        default=_env_number("MAX_QUEUE", COUNT, 16),
        help="requests that may wait (default 16)",
    )
    run.add_argument(
        "--device", type=parse_device, default=_env("DEVICE"), help="cuda, cpu, ... (default: cuda when available)"
    )
    run.add_argument(
        "--dtype",
        choices=WEIGHT_DTYPES,
        default=_env("DTYPE"),
        help="weights dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    run.add_argument(
        "--no-preload",
        dest="preload",
        action="store_false",
        help="load the models on the first request instead of at start",
    )
    form = parser.add_argument_group("form defaults and limits")
    own = "default: the model's own (mhla_diffusion/utils/model_defaults.py); embedded model"
    form.add_argument(
        "--max-sequence-length",
        type=COUNT,
        default=_env_number("MAX_SEQUENCE_LENGTH", COUNT, None),
        help=f"text tokens of the prompt ({own} {d.max_sequence_length})",
    )
    form.add_argument(
        "--num-frames", type=COUNT, default=_env_number("NUM_FRAMES", COUNT, None), help=f"{own} {d.num_frames}"
    )
    form.add_argument("--height", type=COUNT, default=_env_number("HEIGHT", COUNT, None), help=f"{own} {d.height}")
    form.add_argument("--width", type=COUNT, default=_env_number("WIDTH", COUNT, None), help=f"{own} {d.width}")
    form.add_argument(
        "--fps",
        type=COUNT,
        default=_env_number("FPS", COUNT, None),
        help=f"frames per second of the videos ({own} {d.fps})",
    )
    form.add_argument(
        "--video-steps", type=COUNT, default=_env_number("VIDEO_STEPS", COUNT, None), help=f"{own} {d.video_steps}"
    )
    form.add_argument(
        "--video-guidance-scale",
        type=GUIDANCE,
        default=_env_number("VIDEO_GUIDANCE_SCALE", GUIDANCE, None),
        help=f"{own} {d.video_guidance_scale}",
    )
    form.add_argument(
        "--image-steps", type=COUNT, default=_env_number("IMAGE_STEPS", COUNT, None), help=f"{own} {d.image_steps}"
    )
    form.add_argument(
        "--image-guidance-scale",
        type=GUIDANCE,
        default=_env_number("IMAGE_GUIDANCE_SCALE", GUIDANCE, None),
        help=f"{own} {d.image_guidance_scale}",
    )
    form.add_argument(
        "--samples",
        type=SAMPLES,
        default=_env_number("SAMPLES", SAMPLES, UIDefaults.samples),
        help=f"samples per click, seeds seed, seed+1, ... (default {UIDefaults.samples}; at most {Limits.max_samples})",
    )
    form.add_argument(
        "--max-steps", type=COUNT, default=_env_number("MAX_STEPS", COUNT, Limits.max_steps), help="default 100"
    )
    form.add_argument(
        "--max-frames", type=COUNT, default=_env_number("MAX_FRAMES", COUNT, Limits.max_frames), help="default 81"
    )
    form.add_argument(
        "--max-size",
        type=SIZE_LIMIT,
        default=_env_number("MAX_SIZE", SIZE_LIMIT, Limits.max_size),
        help="largest height/width (default 1024)",
    )
    form.add_argument(
        "--max-long-frames",
        type=COUNT,
        default=_env_number("MAX_LONG_FRAMES", COUNT, Limits.max_long_frames),
        help=f"most frames of one long video (default {Limits.max_long_frames})",
    )
    state_ranges(parser)


def resolve_task_models(
    task: Literal["text-to-video", "class-to-image"],
    model: str | None,
    mhla_weights: Path | None,
    transformer: Path | None,
    softmax_model: str | None,
) -> TaskModels:
    """Which folders a task uses (see the module docstring); missing local folders are readable errors."""
    flag = "--t2v" if task == "text-to-video" else "--c2i"
    if model is None:
        if mhla_weights is not None or transformer is not None:
            raise ValueError(f"{flag}-mhla-weights / {flag}-transformer need {flag}-model (the base pipeline)")
        model = str(embedded_model(task, "mhla"))
        if softmax_model is None:
            try:
                softmax_model = str(embedded_model(task, "softmax"))
            except FileNotFoundError:
                softmax_model = None  # compare then runs the MHLA model's weights with softmax attention
    hub_id = WAN_HUB_ID if task == "text-to-video" else DIT_HUB_ID
    check_model_source(model, hub_id, what=f"{flag}-model")
    if softmax_model is not None:
        check_model_source(softmax_model, hub_id, what=f"{flag}-softmax-model")
    for name, path in (("mhla-weights", mhla_weights), ("transformer", transformer)):
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{flag}-{name} {path} does not exist")
    if softmax_model is not None:
        source: SoftmaxSource = "folder"
    elif mhla_weights is not None or transformer is not None:
        source = "base"
    else:
        source = "same"
    return TaskModels(task, model, mhla_weights, transformer, softmax_model, source)


def _causal_mhla(model: str) -> bool | None:
    """Whether the local pipeline folder ``model``'s transformer has block-causal MHLA layers (read from its
    config, nothing loaded); ``None`` for a hub id (the streaming pipeline checks it when it loads)."""
    if not Path(model).is_dir():
        return None
    from ..loaders.plan import read_mhla_config

    meta = read_mhla_config(model, subfolder="transformer")
    return bool(meta and meta["mhla_config"].get("causal"))


def resolve_long_video(model: str | None, num_frames: int | None, limits: Limits) -> LongVideo:
    """The "Long video" tab's model and form defaults (module docstring). A ``--long-model`` that is missing, has
    no block-causal MHLA layers or has no size the form can start at is a readable error; a missing embedded
    model is not (the tab says so)."""
    frames = LONG_VIDEO_FRAMES if num_frames is None else num_frames
    if model is None:
        try:
            model = str(embedded_model("long-video", "mhla"))
        except FileNotFoundError:
            d = embedded_defaults()
            missing = (
                "The embedded long-video model is not built yet: build it with `mhla build-embedded --stream`, or "
                "start the demo with --long-model FOLDER (a block-causal MHLA pipeline folder)"
            )
            sizes = (d.height, d.width, d.video_steps, d.video_guidance_scale, d.fps, d.max_sequence_length)
            return LongVideo(None, frames, *sizes, missing=missing)
    check_model_source(model, WAN_HUB_ID, what="--long-model")
    if _causal_mhla(model) is False:
        raise ValueError(
            f"--long-model {model} has no block-causal MHLA layers: give a pipeline converted with "
            "MHLAConfig(causal=True) and saved with save_pretrained (or leave out --long-model: the embedded one)"
        )
    own = video_defaults(model)
    if own.height is None or own.width is None:
        raise ValueError(
            f"the long-video model {model} has no default frame size (no {RECORD_KEY} in its model_index.json, "
            "not an embedded or published Wan model): record one there"
        )
    long_video = LongVideo(
        model,
        frames,
        own.height,
        own.width,
        own.steps,
        own.guidance_scale,
        own.fps,
        own.max_sequence_length,
        chunk_frames=own.chunk_frames,
    )
    geometry = VideoGeometry.from_folder(model)
    if frames > limits.max_long_frames:
        raise ValueError(f"--long-num-frames {frames} is more than --max-long-frames {limits.max_long_frames}")
    try:
        chunks = stream_chunks(frames, own.chunk_frames, geometry.vae_scale_temporal, geometry.patch_size[0])
        geometry.check_size(chunks.video_frames(0), long_video.height, long_video.width, generation=True)
    except ValueError as error:
        raise ValueError(
            f"the Long video form's default, {frames} frames of {long_video.height}x{long_video.width} "
            f"(--long-num-frames), does not suit {model}: {error}"
        ) from None
    return long_video


def _check_default_size(model: str, defaults: UIDefaults) -> None:
    """The form's default video size against the text-to-video model's own limits (read from its configs,
    before any weights load): a size it cannot take is a readable error naming the limit."""
    geometry = VideoGeometry.from_folder(model)
    try:
        geometry.check_size(defaults.num_frames, defaults.height, defaults.width, generation=True)
    except ValueError as error:
        largest = geometry.max_size()
        limit = f"; its largest size is {largest[0]} frames, {largest[1]}x{largest[2]}" if largest else ""
        raise ValueError(
            f"the form's default video size --num-frames {defaults.num_frames} --height {defaults.height} "
            f"--width {defaults.width} does not suit the text-to-video model{limit}: {error}"
        ) from None


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """A :class:`DemoConfig` from parsed flags; model folders are checked here, before anything loads."""
    if args.concurrency < 1 or args.max_queue < 1:
        raise ValueError("--concurrency and --max-queue must be >= 1")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise ValueError(
            f"--port {args.port} is not a port number: use 1 to 65535 (or leave --port out: 7860 or the next free one)"
        )
    limits = Limits(
        max_steps=args.max_steps,
        max_frames=args.max_frames,
        max_size=args.max_size,
        max_long_frames=args.max_long_frames,
    )
    if not 1 <= args.samples <= limits.max_samples:
        raise ValueError(f"--samples {args.samples} must be from 1 to {limits.max_samples}")
    video = resolve_task_models(
        "text-to-video", args.t2v_model, args.t2v_mhla_weights, args.t2v_transformer, args.t2v_softmax_model
    )
    image = resolve_task_models(
        "class-to-image", args.c2i_model, args.c2i_mhla_weights, args.c2i_transformer, args.c2i_softmax_model
    )
    own_video, own_image = video_defaults(video.model), image_defaults(image.model)

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    missing = [f"--{name.replace('_', '-')}" for name in own_video.missing_size if getattr(args, name) is None]
    if missing:
        raise ValueError(
            f"the text-to-video model {video.model} has no default video size (no {RECORD_KEY} in its "
            f"model_index.json, not an embedded or published Wan model): give {', '.join(missing)}"
        )
    defaults = UIDefaults(
        num_frames=given(args.num_frames, own_video.num_frames),
        height=given(args.height, own_video.height),
        width=given(args.width, own_video.width),
        fps=given(args.fps, own_video.fps),
        video_steps=given(args.video_steps, own_video.steps),
        video_guidance_scale=given(args.video_guidance_scale, own_video.guidance_scale),
        image_steps=given(args.image_steps, own_image.steps),
        image_guidance_scale=given(args.image_guidance_scale, own_image.guidance_scale),
        samples=args.samples,
    )
    max_sequence_length = given(args.max_sequence_length, own_video.max_sequence_length)
    if defaults.fps < 1 or max_sequence_length < 1:
        raise ValueError("--fps and --max-sequence-length must be >= 1")
    for flag, value in (
        ("--video-guidance-scale", defaults.video_guidance_scale),
        ("--image-guidance-scale", defaults.image_guidance_scale),
    ):
        if not math.isfinite(value) or not 0 <= value <= limits.max_guidance:
            raise ValueError(f"{flag} {value} must be a finite number from 0 to {limits.max_guidance:g}")
    _check_default_size(video.model, defaults)
    long_video = resolve_long_video(args.long_model, args.long_num_frames, limits)
    return DemoConfig(
        video=video,
        image=image,
        defaults=defaults,
        limits=limits,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        concurrency=args.concurrency,
        max_queue=args.max_queue,
        preload=args.preload,
        max_sequence_length=max_sequence_length,
        long_video=long_video,
    )
