"""``mhla text-to-video``, ``mhla image-to-video`` and ``mhla class-to-image``.

Every check that needs no model runs first (prompts, the image, sizes and frame count against the model's own
VAE and patch factors, block layout, class names when the model folder is local, output paths), so a
bad command fails before any model loads. Text- and image-to-video are one code path: image-to-video
adds ``--image`` (and needs ``--model``: the embedded demonstration model is text-to-video only).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from ..benchmarks.crossover import speed_context
from ..embedded.locations import embedded_defaults
from ..utils.geometry import VideoGeometry
from .arguments import WAN_480P, add_command, add_model_arguments, non_negative_float, positive_float, positive_int
from .context_parallel import add_context_parallel_arguments, check_context_parallel, start_context_parallel

__all__ = ["register"]

#: Where unset settings come from, for the help texts (the rules: mhla_diffusion/utils/model_defaults.py).
FROM_MODEL = "default: the model's own"
#: The video commands.
VIDEO_TASKS = ("text-to-video", "image-to-video")


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "text-to-video",
        configure_text_to_video,
        help="generate videos from prompts with Wan (2.1, 2.2) + MHLA",
        description="Generate videos with a Diffusers Wan text-to-video pipeline (Wan2.1, Wan2.2-TI2V-5B, "
        "Wan2.2-T2V-A14B) whose self-attention is MHLA.",
    )
    add_command(
        subparsers,
        "image-to-video",
        configure_image_to_video,
        help="generate videos from an image and prompts with Wan image-to-video + MHLA",
        description="Generate videos that start from --image with a Diffusers Wan image-to-video pipeline "
        "(Wan2.1-I2V, Wan2.2-I2V-A14B, Wan2.2-TI2V-5B) whose self-attention is MHLA. Options, outputs and "
        "the JSON settings beside each video are those of `mhla text-to-video`.",
    )
    add_command(
        subparsers,
        "class-to-image",
        configure_class_to_image,
        help="generate class-conditional images with DiT + MHLA",
        description="Generate class-conditional images with a Diffusers DiT pipeline whose self-attention is MHLA.",
    )


def configure_text_to_video(video: argparse.ArgumentParser) -> None:
    from ..loaders.loading import WAN_HUB_ID
    from .stream import add_stream_arguments

    _add_video_arguments(video, WAN_HUB_ID, embedded=True)
    add_stream_arguments(video)
    video.set_defaults(func=run_text_to_video)


def configure_image_to_video(video: argparse.ArgumentParser) -> None:
    from ..loaders.loading import WAN_I2V_HUB_ID

    video.add_argument(
        "--image",
        type=Path,
        required=True,
        help="the first frame (PNG, JPEG, ...; resized to --height x --width), used for every prompt",
    )
    _add_video_arguments(video, WAN_I2V_HUB_ID, embedded=False)
    video.set_defaults(func=run_image_to_video)


def _add_video_arguments(video: argparse.ArgumentParser, hub_id: str, embedded: bool) -> None:
    """The options of the video commands; ``embedded``: the command runs the embedded model without --model."""
    from ..pipelines.outputs import VIDEO_FORMATS

    d, wan = embedded_defaults(), VideoGeometry()

    example = hub_id.rsplit("/", 1)[-1].removesuffix("-Diffusers")  # Wan2.1-T2V-1.3B, Wan2.1-I2V-14B-480P (both 480p)

    def default(embedded_value: Any, wan21: Any) -> str:
        """Where an unset value comes from: the model folder (model_defaults), with examples."""
        return f"{FROM_MODEL}: " + (f"embedded model {embedded_value}, " if embedded else "") + f"{example} {wan21}"

    add_model_arguments(video, hub_id, embedded=embedded)
    video.add_argument(
        "--mhla-weights-2",
        type=Path,
        help="MHLA weights (a save_mhla folder) for transformer_2 of a two-transformer model (Wan2.2-A14B); "
        "or give --mhla-weights a folder with transformer/ and transformer_2/ (what `mhla convert` writes)",
    )
    video.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    video.add_argument("--prompts-file", type=Path, help="a text file with one prompt per line")
    video.add_argument("--negative-prompt", default="", help="negative prompt (default: empty, as the MHLA recipe)")
    video.add_argument(
        "--num-frames",
        type=positive_int,
        help=f"frames as the model's VAE allows them (Wan2.1: {wan.frame_rule()}); others are rounded as "
        f"Diffusers' WanPipeline does ({default(d.num_frames, WAN_480P[0])})",
    )
    for axis, side in enumerate(("height", "width")):
        video.add_argument(
            f"--{side}",
            type=positive_int,
            help=f"pixels, a multiple of what the model's VAE, patch size and Diffusers' WanPipeline "
            f"allow (Wan2.1: {wan.generation_multiple[axis]}; Wan2.2-TI2V-5B: 32) "
            f"({default(getattr(d, side), WAN_480P[axis + 1])})",
        )
    video.add_argument("--steps", type=positive_int, help=f"denoising steps ({default(d.video_steps, 50)})")
    video.add_argument(
        "--guidance-scale",
        type=non_negative_float,
        help=f"classifier-free guidance ({default(d.video_guidance_scale, 5.0)})",
    )
    video.add_argument(
        "--flow-shift", type=positive_float, help="scheduler flow shift (default: the model's, 3.0 for 480p)"
    )
    video.add_argument(
        "--fps", type=positive_int, help=f"frames per second of the written video ({default(d.fps, 16)})"
    )
    video.add_argument("--format", choices=VIDEO_FORMATS, default="mp4", help="mp4, gif or frames (PNG folder)")
    video.add_argument(
        "--max-sequence-length", type=positive_int, help=f"text tokens ({default(d.max_sequence_length, 512)})"
    )
    add_context_parallel_arguments(video)


def configure_class_to_image(image: argparse.ArgumentParser) -> None:
    from ..loaders.loading import DIT_HUB_ID

    d = embedded_defaults()
    add_model_arguments(image, DIT_HUB_ID, family="dit")
    image.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        help="class id or name, or a comma-separated list (repeatable)",
    )
    image.add_argument(
        "--steps", type=positive_int, help=f"denoising steps ({FROM_MODEL}: embedded model {d.image_steps}, DiT 50)"
    )
    image.add_argument(
        "--guidance-scale",
        type=non_negative_float,
        help=f"classifier-free guidance ({FROM_MODEL}: embedded model {d.image_guidance_scale}, DiT 4.0)",
    )
    image.set_defaults(func=run_class_to_image)


# ---------------------------------------------------------------- checks that need no model


def _apply_defaults(args: argparse.Namespace, task: str) -> None:
    """The model, then every unset option from it (:mod:`mhla_diffusion.utils.model_defaults`).

    Without --model: the embedded model (with --stream the embedded long-video model), and with --attention softmax
    its softmax teacher (the embedded MHLA model's weights are trained for MHLA), said on stderr. A local --model
    must exist; a video model that records no size needs --num-frames, --height and --width.
    """
    from ..embedded.locations import embedded_model
    from ..loaders.loading import DIT_HUB_ID, WAN_HUB_ID, WAN_I2V_HUB_ID, check_model_source
    from ..utils.model_defaults import RECORD_KEY, image_defaults, video_defaults

    if args.model is None:  # never for image-to-video, whose --model is required
        if args.mhla_weights is not None or args.transformer is not None or getattr(args, "mhla_weights_2", None):
            raise ValueError("--mhla-weights / --mhla-weights-2 / --transformer need the --model they belong to")
        streaming = getattr(args, "stream", False)  # the embedded long-video model streams; the others do not
        args.model = str(embedded_model("long-video" if streaming else task, args.attention))
        if args.attention == "softmax":
            print(
                f"--attention softmax: generating with the embedded softmax teacher {args.model} (the embedded "
                "MHLA model's weights are trained for MHLA; --model picks another folder)",
                file=sys.stderr,
            )
    check_model_source(
        args.model,
        {"text-to-video": WAN_HUB_ID, "image-to-video": WAN_I2V_HUB_ID}.get(task, DIT_HUB_ID),
        what="--model",
    )
    if task in VIDEO_TASKS:
        d = video_defaults(args.model)
        values = dict(
            num_frames=d.num_frames,
            height=d.height,
            width=d.width,
            steps=d.steps,
            guidance_scale=d.guidance_scale,
            fps=d.fps,
            max_sequence_length=d.max_sequence_length,
        )
        if getattr(args, "stream", False):
            values["chunk_frames"] = d.chunk_frames  # the chunk a block-causal model trained with (None: the rule's)
            # and its first chunk, when the chunks are the recorded ones (--chunk-frames: all chunks alike)
            args.first_chunk_frames = d.first_chunk_frames if args.chunk_frames is None else None
        missing = [f"--{name.replace('_', '-')}" for name in d.missing_size if getattr(args, name) is None]
        if missing:
            raise ValueError(
                f"{args.model} has no default video size (no {RECORD_KEY} in its model_index.json, "
                f"not an embedded or published Wan model): give {', '.join(missing)}, or record them in the folder "
                "(pipe.record_generation_defaults(num_frames=..., height=..., width=...), then save_pretrained)"
            )
    else:
        d = image_defaults(args.model)
        values = dict(steps=d.steps, guidance_scale=d.guidance_scale)
    for name, value in values.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _load_plan(args: argparse.Namespace) -> Any:
    """The run's :class:`~mhla_diffusion.loaders.plan.PipelinePlan`: --model, the MHLA weights per transformer and
    --transformer, resolved once (small config files only) and checked against each other before any model loads."""
    from ..loaders.loading import device_and_dtype
    from ..loaders.plan import plan_pipeline

    _, dtype = device_and_dtype(args.device, args.dtype)
    return plan_pipeline(
        args.model, args.mhla_weights, getattr(args, "mhla_weights_2", None), args.transformer, dtype=dtype
    )


def _read_image(path: Path) -> Any:
    """The ``--image`` as an RGB ``PIL.Image``, read before any model loads."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"--image {path} does not exist")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"--image {path} is not an image this installation can read ({error})") from None


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise FileNotFoundError(f"--prompts-file {args.prompts_file} does not exist")
        lines = [line.strip() for line in args.prompts_file.read_text().splitlines()]
        from_file = [line for line in lines if line]
        if not from_file:
            raise ValueError(f"--prompts-file {args.prompts_file} has no prompts (one per line)")
        prompts += from_file
    if not prompts:
        raise ValueError("give a prompt with --prompt or a file of prompts with --prompts-file")
    if any(not p.strip() for p in prompts):
        raise ValueError("empty prompt: every --prompt needs some text")
    return prompts


def _video_frames(args: argparse.Namespace, geometry: VideoGeometry) -> int:
    """Check the video size against the model's factors; return the frame count actually generated.

    A frame count the VAE cannot produce is rounded as Diffusers' ``WanPipeline`` does, with a warning. A streamed
    run's count is checked by the chunk rule (:mod:`.stream`) and may run past the rotary table.
    """
    frames = args.num_frames
    if getattr(args, "stream", False):
        geometry.check_resolution(args.height, args.width, generation=True)
    elif not geometry.valid_frames(frames):
        frames = geometry.round_frames(frames)  # a ValueError below 1
        print(
            f"warning: --num-frames {args.num_frames} is not {geometry.frame_rule(examples=False)} "
            f"({geometry.describe()}); generating {frames} frames",
            file=sys.stderr,
        )
    if not getattr(args, "stream", False):
        geometry.check_size(frames, args.height, args.width, generation=True)
    for name in ("steps", "fps", "max_sequence_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.guidance_scale < 0:
        raise ValueError("--guidance-scale must be >= 0")
    return frames


def _settings(args: argparse.Namespace, pipe, device: str, dtype, **extra: Any) -> dict[str, Any]:
    from .. import __version__

    mhla: dict[str, Any] = {}
    for name, conversion in pipe.mhla_conversions.items():  # "transformer" -> mhla_layers, "transformer_2" -> ..._2
        used = conversion if args.attention == "mhla" else None
        suffix = name[len("transformer") :]
        mhla[f"mhla_layers{suffix}"] = used.layers if used else []
        mhla[f"block_layout{suffix}"] = list(used.layout) if used else None
    return {
        **extra,
        "seed": args.seed,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "model": args.model,
        "mhla_weights": str(args.mhla_weights) if args.mhla_weights else None,
        "transformer": str(args.transformer) if args.transformer else None,
        "attention": args.attention,
        **mhla,
        "scheduler": type(pipe.scheduler).__name__,
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "mhla_diffusion_version": __version__,
    }


def _load(cls: type, args: argparse.Namespace, plan: Any, component_dtypes_of=None):
    """The device, dtype and pipeline of a run, loaded by its ``plan`` (:func:`_load_plan`); the process keeps freed
    memory when it runs on the CPU."""
    from ..loaders.loading import device_and_dtype, load_pipeline
    from ..ops.cpu_memory import retain_freed_memory

    device, dtype = device_and_dtype(args.device, args.dtype)
    if device == "cpu":
        retain_freed_memory()  # large tensors would otherwise be page-faulted in on every step
    pipe = load_pipeline(
        cls,
        plan,
        attention=args.attention,
        dtype=dtype,
        component_dtypes=component_dtypes_of() if component_dtypes_of else None,
    )
    return device, dtype, pipe


def _warn_block_causal(args: argparse.Namespace, declared: list[Any], plan: Any) -> None:
    """Say on stderr when a run without ``--stream`` generates with a block-causal model (made to stream): it then
    makes one block-causal pass over the whole clip, bounded by the rotary table, which ``--stream`` is not
    (``plan``: the run's :func:`_load_plan`)."""
    from ..utils.stream_frames import BLOCK_CAUSAL_KEY

    causal = any(meta["mhla_config"].get("causal") for meta in declared)
    if args.attention == "softmax":
        own = plan.model.components.get("transformer")
        causal = bool(((own.config if own is not None else None) or {}).get(BLOCK_CAUSAL_KEY))
    if causal:
        print(
            f"note: {args.model} is block-causal (made to stream): generating the clip in one block-causal pass; "
            "add --stream to generate it chunk by chunk (any length, memory flat)",
            file=sys.stderr,
        )


# ---------------------------------------------------------------- the embedded judges


def _judge_reader(model: str) -> Any:
    """The judge that reads an embedded model's samples (a ``JudgeReader``), or ``None`` for other models."""
    from ..embedded.locations import embedded_folder

    folder = embedded_folder(model)
    if folder is None:
        return None
    from ..embedded.judges.judge_reading import JudgeReader

    return JudgeReader(folder.judge())


def _judge(reader: Any, sample: Any, read: Callable[[], Any]) -> tuple[dict[str, Any], str]:
    """``({"judge": ...}, "  judge: ...")`` for one sample's JSON and printed line (``({}, "")`` without a
    judge); ``read()`` gives the reading. A sample of another size than the judge's is recorded as unread."""
    if reader is None:
        return {}, ""
    why = reader.unreadable(sample.shape)
    if why is not None:
        return {"judge": {"reading": None, "why": why}}, f"  (no judge reading: {why})"
    reading = read()
    return {"judge": reading.to_json()}, f"  {reading.describe()}"


def _judge_long_video(reader: Any, chunks: list[Any], prompt: str) -> tuple[dict[str, Any], str]:
    """A streamed embedded video's judge reading (:func:`~mhla_diffusion.embedded.builds.long_video.measure_long_video`:
    shape and colour per 9-frame window, the centroid's largest jump) for its JSON and printed line."""
    import numpy as np

    from ..embedded.builds.long_video import measure_long_video

    starts = [int(s) for s in np.cumsum([len(chunk) for chunk in chunks])[:-1]]
    try:
        measures = measure_long_video(reader.judge, np.concatenate(chunks), prompt, starts)
    except ValueError as error:  # a prompt the judge cannot compare with, a video shorter than one window
        return {"judge": {"reading": None, "why": str(error)}}, f"  (no judge reading: {error})"
    matching = round(measures.window_match * measures.num_windows)
    line = (
        f"  judge: shape and colour as asked in {matching}/{measures.num_windows} windows, largest centroid jump "
        f"{measures.max_jump:.1f} px"
    )
    return {"judge": measures.to_json()}, line


# ---------------------------------------------------------------- commands


def run_text_to_video(args: argparse.Namespace) -> int:
    return _run_video(args, "text-to-video")


def run_image_to_video(args: argparse.Namespace) -> int:
    return _run_video(args, "image-to-video")


def _run_video(args: argparse.Namespace, task: str) -> int:
    """``mhla text-to-video`` and ``mhla image-to-video`` (``task``): checks, then one video per prompt."""
    from ..pipelines.outputs import (
        check_settings,
        plan_outputs,
        save_video,
        slugify,
        write_settings,
    )
    from ..utils.geometry import check_layout_fits
    from .stream import announce_stream, check_stream, check_stream_model, stream_grid, stream_settings

    _apply_defaults(args, task)  # the model folder exists from here on
    prompts = _read_prompts(args)
    image = _read_image(args.image) if task == "image-to-video" else None
    geometry = VideoGeometry.from_folder(args.model)  # Wan2.1's factors for a hub id
    chunks = check_stream(args, geometry) if task == "text-to-video" else None  # None without --stream
    num_frames = _video_frames(args, geometry)
    # what attention sees: a stream's largest chunk (its length is not bounded by the rotary table), else the clip
    if chunks is not None:
        grid = stream_grid(geometry, chunks, args.height, args.width)
    else:
        grid = geometry.token_grid(num_frames, args.height, args.width)
    check_context_parallel(args, grid)  # degree vs launch, split
    plan = _load_plan(args)
    if task == "image-to-video":
        from ..pipelines.wan_i2v import check_text_tokens

        configs = [part.config for part in plan.model.components.values()]  # the pipeline's transformers'
        check_text_tokens([c for c in configs if c is not None], args.max_sequence_length, "--max-sequence-length is")
    declared = plan.declared_mhla() if args.attention == "mhla" else []
    if chunks is not None:
        check_stream_model(args, declared)
    else:
        _warn_block_causal(args, declared, plan)
    what = f"a {num_frames}x{args.height}x{args.width} video" + (" (the chunk's grid)" if chunks else "")
    for meta in declared:
        # a grid smaller than the layout is fine (empty blocks); not with scalar_mixed_denominator
        check_layout_fits(
            grid,
            meta["mhla_config"]["layout"],
            what,
            meta["mhla_config"].get("normalization", "denominator"),
        )
    stems = [f"{i:03d}-{slugify(p)}-seed{args.seed}-{args.attention}" for i, p in enumerate(prompts)]
    parallel = start_context_parallel(args)  # None without --context-parallel; with it rank 0 alone plans and writes
    if parallel is None:
        plans = plan_outputs(args.output_dir, stems, args.format, args.overwrite)
    else:
        plans = parallel.on_main(plan_outputs, args.output_dir, stems, args.format, args.overwrite)

    import torch

    if task == "image-to-video":
        from ..pipelines.wan_i2v import MHLAWanImageToVideoPipeline as pipeline_class
    else:
        from ..pipelines.wan import MHLAWanPipeline as pipeline_class
    if chunks is not None:
        from ..pipelines.wan_streaming import MHLAWanStreamingPipeline as pipeline_class

    device, dtype, pipe = _load(pipeline_class, args, plan, lambda: {"vae": torch.float32})
    if args.flow_shift is not None:
        key = "flow_shift" if "flow_shift" in pipe.scheduler.config else "shift"
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, **{key: args.flow_shift})
    pipe.to(device)  # the loaded model's own size limits: the pipeline's __call__ checks them before any work
    if parallel is not None:
        parallel.enable(pipe, args)  # the transformers split each video's tokens across the processes
    for index, prompt in enumerate(prompts):
        unknown = pipe.unknown_words(prompt)
        if unknown:
            print(
                f"warning: prompt {index + 1} has words the model's tokenizer does not know, generated without them: "
                f"{', '.join(map(repr, unknown))}",
                file=sys.stderr,
            )
    flow_shift = pipe.scheduler.config.get("flow_shift", pipe.scheduler.config.get("shift"))
    conditioning = {"image": image} if image is not None else {}
    recorded = {"image": str(args.image)} if image is not None else {}
    recorded["mhla_weights_2"] = plan.weights_folder("transformer_2")
    recorded["context_parallel"] = args.context_parallel
    check_settings(
        _settings(args, pipe, device, dtype, flow_shift=flow_shift)
    )  # before generating: valid JSON sidecars
    reader = _judge_reader(args.model) if parallel is None or parallel.is_main else None
    # beside wall_time_s: the tokens one attention call sees (a stream's: its chunk's)
    speed = speed_context(math.prod(grid if chunks else pipe.token_grid(num_frames, args.height, args.width)))
    if chunks is not None:
        announce_stream(chunks, args.fps, args.steps)
    attention = pipe.softmax_attention() if args.attention == "softmax" else nullcontext()
    with attention:
        for index, (prompt, plan) in enumerate(zip(prompts, plans)):
            started = time.perf_counter()
            clip = dict(prompt=prompt, negative_prompt=args.negative_prompt, num_frames=num_frames)
            clip.update(height=args.height, width=args.width)
            call = dict(
                **conditioning,
                **clip,
                num_inference_steps=args.steps,
                guidance_scale=args.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(args.seed),
                output_type="np",
                max_sequence_length=args.max_sequence_length,
            )
            if chunks is not None and args.state_dtype is not None:
                call["state_dtype"] = getattr(torch, args.state_dtype)
            recorded_run = dict(task=task, **recorded, **clip, fps=args.fps, flow_shift=flow_shift)
            recorded_run.update(boundary_ratio=pipe.config.get("boundary_ratio"), output=str(plan.media))

            def settings(**more: Any) -> dict[str, Any]:
                return _settings(args, pipe, device, dtype, **recorded_run, **more)

            frames, judged_chunks = None, []
            if chunks is not None:  # each chunk's frames go into the file as they are decoded
                stopped = _stream_video(
                    pipe, call, chunks, plan, args.format, args.fps, settings, speed, reader is not None
                )
                if isinstance(stopped, int):
                    return stopped
                judged_chunks = stopped
            else:
                try:
                    frames = pipe(**call).frames[0]
                except KeyboardInterrupt:
                    done = f"; the {index} finished video(s) are in {args.output_dir}" if index else ""
                    print(
                        f"mhla {task}: interrupted: video {index + 1} of {len(prompts)} was not finished and nothing "
                        f"was written for it{done} (--stream writes a long video as it is made)",
                        file=sys.stderr,
                    )
                    return 130
            wall = time.perf_counter() - started
            if parallel is not None and not parallel.is_main:
                continue  # every process holds the same video; rank 0 writes it
            judged, line = {}, ""
            if frames is not None:
                save_video(frames, plan, args.format, args.fps)
                judged, line = _judge(reader, frames, lambda: reader.read_videos(frames[None], [prompt])[0])
            elif judged_chunks:
                judged, line = _judge_long_video(reader, judged_chunks, prompt)
            done = (
                {}
                if chunks is None
                else dict(status="complete", frames_written=num_frames, chunks_written=chunks.num_chunks)
            )
            write_settings(
                plan,
                settings(
                    wall_time_s=round(wall, 3),
                    speed=speed,
                    **(stream_settings(chunks) if chunks is not None else {}),
                    **done,
                    **judged,
                ),
            )
            print(f"[{index + 1}/{len(prompts)}] {plan.media}  ({args.attention}, {wall:.2f} s){line}")
    if parallel is not None:
        parallel.close()
    return 0


def _stream_video(
    pipe: Any,
    call: dict[str, Any],
    chunks: Any,
    plan: Any,
    fmt: str,
    fps: int,
    settings: Callable[..., dict[str, Any]],
    speed: Any,
    judged: bool,
) -> list[Any] | int:
    """One streamed video (``--stream``): each chunk's frames go into ``plan.media`` as they are decoded, and the
    settings JSON is written before the first chunk (``status: running``) and after every chunk
    (``frames_written``, ``chunks_written``), so a killed run leaves a playable video with a JSON that says how far it
    got. Returns the chunks' frames as ``uint8`` for the embedded judge (``judged``; else ``[]``), or, after Ctrl-C,
    the exit code, once the kept frames' JSON is complete and one line has said what was kept."""
    from ..pipelines.interrupt import GenerationInterrupted, kept_line
    from ..pipelines.outputs import VideoWriter, float_to_uint8, write_settings
    from .stream import stream_settings

    started = time.perf_counter()
    kept_chunks: list[Any] = []
    progress = dict(speed=speed, **stream_settings(chunks), status="running", frames_written=0, chunks_written=0)
    with VideoWriter(plan, fmt, fps) as writer:
        write_settings(plan, settings(**progress))

        def deliver(chunk: Any) -> None:
            writer.append(chunk[0])
            progress.update(frames_written=writer.frames_written, chunks_written=progress["chunks_written"] + 1)
            write_settings(plan, settings(**progress))
            if judged:  # an embedded model's small frames, kept for its judge
                kept_chunks.append(float_to_uint8(chunk[0]))

        try:
            pipe(
                **call,
                chunk_frames=chunks.chunk_frames,
                first_chunk_frames=chunks.first_frames,
                on_frames=deliver,
                return_frames=False,
            )
            return kept_chunks
        except GenerationInterrupted as interrupted:
            stopped = interrupted
    # the file is closed: every finished chunk's frames are in it
    progress.update(status="interrupted", frames_written=writer.frames_written)
    write_settings(plan, settings(**progress, wall_time_s=round(time.perf_counter() - started, 3)))
    kept = kept_line(writer.frames_written, chunks.num_frames, stopped.chunks_done, chunks.num_chunks)
    print(f"mhla text-to-video: interrupted: {kept} in {plan.media} (settings: {plan.settings})", file=sys.stderr)
    return stopped.exit_code


def run_class_to_image(args: argparse.Namespace) -> int:
    from ..loaders.loading import local_labels
    from ..pipelines.class_labels import resolve_class_ids
    from ..pipelines.outputs import plan_outputs, save_image, slugify, write_settings
    from ..utils.options import list_items

    if args.transformer is not None and args.transformer.is_file():
        raise ValueError(
            f"--transformer {args.transformer} is a file: class-to-image takes a transformer folder; convert an "
            "original DiT checkpoint with `mhla import-dit FILE --output FOLDER` first"
        )
    _apply_defaults(args, "class-to-image")  # the model folder exists from here on
    plan = _load_plan(args)
    classes = [c for item in args.classes for c in list_items(item)]  # the option layer's list rule
    if not classes:
        raise ValueError("give at least one --class (an id such as 207 or a name such as 'golden retriever')")
    if args.steps < 1 or args.guidance_scale < 0:
        raise ValueError("--steps must be >= 1 and --guidance-scale >= 0")
    local = local_labels(args.model)
    if local is not None:
        resolve_class_ids(classes, *local)
    stems = [f"{i:03d}-{slugify(c)}-seed{args.seed}-{args.attention}" for i, c in enumerate(classes)]
    plans = plan_outputs(args.output_dir, stems, "png", args.overwrite)

    import torch

    from ..pipelines.dit import MHLADiTPipeline

    device, dtype, pipe = _load(MHLADiTPipeline, args, plan)
    ids = pipe.class_ids(classes)
    pipe.to(device)
    attention = pipe.softmax_attention() if args.attention == "softmax" else nullcontext()
    started = time.perf_counter()
    with attention:
        images = pipe(
            class_labels=ids,
            guidance_scale=args.guidance_scale,
            num_inference_steps=args.steps,
            generator=torch.Generator("cpu").manual_seed(args.seed),
            output_type="np",
        ).images
    wall = time.perf_counter() - started
    config = pipe.transformer.config
    speed = speed_context((config.sample_size // config.patch_size) ** 2)  # beside wall_time_s
    reader = _judge_reader(args.model)
    for name, class_id, image, plan in zip(classes, ids, images, plans):
        save_image(image, plan)
        judged, line = _judge(reader, image, lambda: reader.read_images(image[None], [class_id])[0])
        write_settings(
            plan,
            _settings(
                args,
                pipe,
                device,
                dtype,
                task="class-to-image",
                class_name=name,
                class_id=class_id,
                batch_size=len(ids),
                output=str(plan.media),
                wall_time_s=round(wall, 3),
                speed=speed,
                **judged,
            ),
        )
        print(f"{plan.media}  (class {class_id}){line}")
    print(f"{len(ids)} image(s) in {wall:.2f} s ({args.attention})")
    return 0
