"""``mhla text-to-video``, ``mhla class-to-image`` and ``mhla import-wan``.

Every check that needs no model runs first (prompts, sizes, frame count, block layout, class
names when the model folder is local, output paths), so a bad command fails in a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..block_layout import validate_grid_layout
from ..weights import read_mhla_config
from .dit import label_index, resolve_class_ids
from .outputs import VIDEO_FORMATS, plan_outputs, save_image, save_video, slugify, write_settings

__all__ = ["check_model_source", "device_and_dtype", "load_pipeline", "local_labels", "register"]

WAN_HUB_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
DIT_HUB_ID = "facebook/DiT-XL-2-256"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the generation subcommands to the ``mhla`` parser."""
    video = subparsers.add_parser(
        "text-to-video", help="generate videos from prompts with Wan2.1 + MHLA",
        description="Generate videos with a Diffusers Wan2.1 pipeline whose self-attention is MHLA.",
    )
    _add_model_args(video, WAN_HUB_ID)
    video.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    video.add_argument("--prompts-file", type=Path, help="a text file with one prompt per line")
    video.add_argument("--negative-prompt", default="", help="negative prompt (default: empty, as the MHLA recipe)")
    video.add_argument("--num-frames", type=int, help="frames, 4k+1 (default 81; embedded model: 17)")
    video.add_argument("--height", type=int, help="pixels, a multiple of 16 (default 480; embedded model: 64)")
    video.add_argument("--width", type=int, help="pixels, a multiple of 16 (default 832; embedded model: 64)")
    video.add_argument("--steps", type=int, help="denoising steps (default 50; embedded model: 20)")
    video.add_argument("--guidance-scale", type=float, help="classifier-free guidance (default 5.0)")
    video.add_argument("--flow-shift", type=float, help="scheduler flow shift (default: the model's, 3.0 for 480p)")
    video.add_argument("--fps", type=int, help="frames per second of the written video (default 16; embedded model: 8)")
    video.add_argument("--format", choices=VIDEO_FORMATS, default="mp4", help="mp4, gif or frames (PNG folder)")
    video.add_argument("--max-sequence-length", type=int, help="text tokens (default 512; embedded model: 16)")
    video.set_defaults(func=_run_text_to_video)

    image = subparsers.add_parser(
        "class-to-image", help="generate class-conditional images with DiT + MHLA",
        description="Generate class-conditional images with a Diffusers DiT pipeline whose self-attention is MHLA.",
    )
    _add_model_args(image, DIT_HUB_ID)
    image.add_argument("--class", dest="classes", action="append", default=[],
                       help="class id or name, or a comma-separated list (repeatable)")
    image.add_argument("--steps", type=int, help="denoising steps (default 50; embedded model: 25)")
    image.add_argument("--guidance-scale", type=float, help="classifier-free guidance (default 4.0)")
    image.set_defaults(func=_run_class_to_image)

    imp = subparsers.add_parser(
        "import-wan", help="convert an original-format Wan (+MHLA) checkpoint to a Diffusers transformer folder",
        description="Convert a checkpoint in the original Wan key format (e.g. the one released with the MHLA "
        "paper) into a Diffusers transformer folder with MHLA layers; use it with --transformer.",
    )
    imp.add_argument("checkpoint", type=Path, help=".safetensors, .pt or .pth file")
    imp.add_argument("--output", type=Path, required=True, help="folder for the converted transformer")
    imp.add_argument("--layout", help="block layout of the MHLA layers, e.g. 3x5x10 (default for 150 blocks)")
    imp.add_argument("--attention-head-dim", type=int, default=128, help="head dim (128 for every Wan2.1 size)")
    imp.add_argument("--overwrite", action="store_true", help="replace files already in --output")
    imp.set_defaults(func=_run_import_wan)


def _add_model_args(p: argparse.ArgumentParser, hub_id: str) -> None:
    p.add_argument("--model", help=f"Diffusers pipeline folder or hub id (e.g. {hub_id}); default: the small "
                   "embedded demonstration model (mhla_diffusion/embedded/models)")
    p.add_argument("--mhla-weights", type=Path, help="folder written by save_mhla / `mhla convert --output`")
    p.add_argument("--transformer", type=Path, help="a converted transformer folder (save_mhla include_base, import-wan)")
    p.add_argument("--attention", choices=("mhla", "sdpa"), default="mhla",
                   help="mhla (default) or sdpa: the same weights with the original softmax attention")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--output-dir", type=Path, default=Path("outputs"), help="where outputs go (default ./outputs)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weights dtype (default: bfloat16 on GPU, float32 on CPU)")


# ---------------------------------------------------------------- checks that need no model


def _looks_local(model: str) -> bool:
    return os.path.exists(model) or os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") != 1


def check_model_source(model: str, hub_id: str) -> None:
    """A readable ``FileNotFoundError`` when ``model`` looks like a local folder that does not exist."""
    if _looks_local(model) and not os.path.isdir(model):
        raise FileNotFoundError(
            f"model folder {model} not found. Get the weights with `huggingface-cli download {hub_id} --local-dir {model}` "
            f"on a machine with internet, or pass the hub id `{hub_id}`"
        )


def _declared_mhla(args: argparse.Namespace) -> dict[str, Any] | None:
    """The MHLA config the run will use, when it can be read without loading a model."""
    if args.mhla_weights is not None:
        meta = read_mhla_config(args.mhla_weights)
        if meta is None:
            raise FileNotFoundError(
                f"--mhla-weights {args.mhla_weights} has no mhla_config.json: give a folder written by save_mhla"
            )
        return meta
    if args.transformer is not None and args.transformer.is_dir():
        return read_mhla_config(args.transformer)
    if os.path.isdir(args.model):
        return read_mhla_config(args.model, subfolder="transformer")
    return None


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


def _check_video_size(args: argparse.Namespace) -> int:
    """Validate sizes; return the frame count actually generated (4k+1, rounded down as Diffusers does)."""
    for name in ("height", "width"):
        value = getattr(args, name)
        if value < 16 or value % 16:
            raise ValueError(f"--{name} {value} must be a positive multiple of 16 (VAE scale 8 x patch 2)")
    frames = args.num_frames
    if frames < 1:
        raise ValueError(f"--num-frames {frames} must be >= 1 (4k+1: 1, 5, ..., 81)")
    if frames % 4 != 1:
        frames = frames // 4 * 4 + 1
        print(f"warning: --num-frames {args.num_frames} is not 4k+1; generating {frames} frames", file=sys.stderr)
    for name in ("steps", "fps", "max_sequence_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.guidance_scale < 0:
        raise ValueError("--guidance-scale must be >= 0")
    return frames


def _check_grid_fits(grid: tuple[int, ...], meta: dict[str, Any] | None, what: str) -> None:
    if meta is None:
        return
    layout = tuple(meta["mhla_config"]["layout"])
    try:
        validate_grid_layout(grid, layout)
    except ValueError:
        raise ValueError(
            f"{what} has token grid {grid}, smaller than the MHLA block layout {layout} on some axis: "
            "ask for more frames or a larger size"
        ) from None


def device_and_dtype(device: str | None = None, dtype: str | None = None):
    """``(device, torch dtype)``: cuda when available, bfloat16 on GPU and float32 on CPU unless given."""
    import torch

    from ..cpu_memory import retain_freed_memory

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if device == "cpu":
        retain_freed_memory()  # large tensors would otherwise be page-faulted in on every step
    return device, getattr(torch, name)


def _device_and_dtype(args: argparse.Namespace):
    return device_and_dtype(args.device, args.dtype)


# ---------------------------------------------------------------- model loading


def _load_transformer_arg(path: Path, dtype) -> Any:
    from ..original_format import load_original_wan
    from ..weights import load_mhla, load_transformer

    if path.is_file():
        return load_original_wan(path, dtype=dtype)
    if not path.is_dir():
        raise FileNotFoundError(f"--transformer {path} does not exist")
    if read_mhla_config(path) is not None:
        return load_mhla(path, dtype=dtype)
    return load_transformer(path, dtype=dtype)


def load_pipeline(
    cls: type, model: str | os.PathLike, *, mhla_weights: Path | None = None, transformer: Path | None = None,
    attention: str = "mhla", dtype=None, component_dtypes: dict | None = None,
):
    """Load ``cls`` (``MHLAWanPipeline`` / ``MHLADiTPipeline``) as ``--model`` / ``--mhla-weights`` / ``--transformer`` say.

    With ``attention="mhla"`` a model without MHLA layers is a ``ValueError``.
    """
    kwargs: dict[str, Any] = {"dtype": {"default": dtype, **(component_dtypes or {})} if component_dtypes else dtype}
    if transformer is not None:
        kwargs["transformer"] = _load_transformer_arg(Path(transformer), dtype)
    pipe = cls.from_pretrained(model, mhla_weights=mhla_weights, **kwargs)
    if attention == "mhla" and pipe.mhla is None:
        raise ValueError(
            "--attention mhla, but the model has no MHLA layers: pass --mhla-weights, a --transformer with MHLA, "
            "or a folder saved by our pipeline (use --attention sdpa for the plain softmax model)"
        )
    return pipe


def _load_pipeline(cls: type, args: argparse.Namespace, dtype, component_dtypes: dict | None = None):
    return load_pipeline(cls, args.model, mhla_weights=args.mhla_weights, transformer=args.transformer,
                         attention=args.attention, dtype=dtype, component_dtypes=component_dtypes)


def _settings(args: argparse.Namespace, pipe, device: str, dtype, **extra: Any) -> dict[str, Any]:
    from .. import __version__

    conversion = pipe.mhla
    return {
        **extra,
        "seed": args.seed,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "model": args.model,
        "mhla_weights": str(args.mhla_weights) if args.mhla_weights else None,
        "transformer": str(args.transformer) if args.transformer else None,
        "attention": args.attention,
        "mhla_layers": conversion.layers if conversion and args.attention == "mhla" else [],
        "block_layout": list(conversion.layout) if conversion and args.attention == "mhla" else None,
        "scheduler": type(pipe.scheduler).__name__,
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "mhla_diffusion_version": __version__,
    }


# ---------------------------------------------------------------- subcommands


def _apply_defaults(args: argparse.Namespace, task: str) -> None:
    """Fill unset options: the embedded model and its settings without --model, else the real models' defaults."""
    from ..embedded import embedded_defaults, embedded_model

    embedded = args.model is None
    if embedded:
        if args.mhla_weights is not None or args.transformer is not None:
            raise ValueError("--mhla-weights / --transformer need the --model they belong to")
        args.model = str(embedded_model(task, "mhla"))
    d = embedded_defaults()
    if task == "text-to-video":
        values = dict(num_frames=d.num_frames, height=d.height, width=d.width, steps=d.video_steps,
                      guidance_scale=d.video_guidance_scale, fps=d.fps, max_sequence_length=d.max_sequence_length)
        if not embedded:
            values = dict(num_frames=81, height=480, width=832, steps=50, guidance_scale=5.0, fps=16,
                          max_sequence_length=512)
    else:
        values = dict(steps=d.image_steps, guidance_scale=d.image_guidance_scale) if embedded else dict(
            steps=50, guidance_scale=4.0)
    for name, value in values.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _local_video_geometry(model: str) -> dict[str, tuple[int, ...]]:
    """Patch size and VAE scale of a local Wan pipeline folder (``{}`` for hub ids: Wan2.1's defaults apply)."""
    folder = Path(model)
    try:
        transformer = json.loads((folder / "transformer" / "config.json").read_text())
        vae = json.loads((folder / "vae" / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    temporal, spatial = int(vae.get("scale_factor_temporal", 4)), int(vae.get("scale_factor_spatial", 8))
    return {"patch_size": tuple(int(p) for p in transformer.get("patch_size", (1, 2, 2))),
            "vae_scale": (temporal, spatial, spatial)}


def _run_text_to_video(args: argparse.Namespace) -> int:
    from ..geometry import video_token_grid

    _apply_defaults(args, "text-to-video")
    prompts = _read_prompts(args)
    num_frames = _check_video_size(args)
    check_model_source(args.model, WAN_HUB_ID)
    meta = _declared_mhla(args) if args.attention == "mhla" else None
    geometry = _local_video_geometry(args.model) if os.path.isdir(args.model) else {}
    _check_grid_fits(video_token_grid(num_frames, args.height, args.width, **geometry), meta,
                     f"a {num_frames}x{args.height}x{args.width} video")
    stems = [f"{i:03d}-{slugify(p)}-seed{args.seed}-{args.attention}" for i, p in enumerate(prompts)]
    plans = plan_outputs(args.output_dir, stems, args.format, args.overwrite)

    import torch

    from .wan import MHLAWanPipeline

    device, dtype = _device_and_dtype(args)
    pipe = _load_pipeline(MHLAWanPipeline, args, dtype, {"vae": torch.float32})
    if args.flow_shift is not None:
        key = "flow_shift" if "flow_shift" in pipe.scheduler.config else "shift"
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, **{key: args.flow_shift})
    pipe.to(device)
    if args.attention == "mhla":
        pipe.check_mhla_size(num_frames, args.height, args.width)
    attention = pipe.softmax_attention() if args.attention == "sdpa" else nullcontext()
    with attention:
        for index, (prompt, plan) in enumerate(zip(prompts, plans)):
            started = time.perf_counter()
            frames = pipe(
                prompt=prompt, negative_prompt=args.negative_prompt, num_frames=num_frames, height=args.height,
                width=args.width, num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(args.seed), output_type="np",
                max_sequence_length=args.max_sequence_length,
            ).frames[0]
            wall = time.perf_counter() - started
            save_video(frames, plan, args.format, args.fps)
            write_settings(plan, _settings(
                args, pipe, device, dtype, task="text-to-video", prompt=prompt, negative_prompt=args.negative_prompt,
                num_frames=num_frames, height=args.height, width=args.width, fps=args.fps,
                flow_shift=pipe.scheduler.config.get("flow_shift", pipe.scheduler.config.get("shift")),
                output=str(plan.media), wall_time_s=round(wall, 3),
            ))
            print(f"[{index + 1}/{len(prompts)}] {plan.media}  ({args.attention}, {wall:.2f} s)")
    return 0


def local_labels(model: str) -> tuple[dict[str, int], int] | None:
    """Labels and class count of a local DiT pipeline folder, read without loading it."""
    index, config = Path(model, "model_index.json"), Path(model, "transformer", "config.json")
    if not (index.is_file() and config.is_file()):
        return None
    id2label = json.loads(index.read_text()).get("id2label")
    return label_index(id2label), int(json.loads(config.read_text()).get("num_embeds_ada_norm") or 1000)


def _run_class_to_image(args: argparse.Namespace) -> int:
    _apply_defaults(args, "class-to-image")
    classes = [c.strip() for item in args.classes for c in item.split(",") if c.strip()]
    if not classes:
        raise ValueError("give at least one --class (an id such as 207 or a name such as 'golden retriever')")
    if args.steps < 1 or args.guidance_scale < 0:
        raise ValueError("--steps must be >= 1 and --guidance-scale >= 0")
    check_model_source(args.model, DIT_HUB_ID)
    local = local_labels(args.model) if os.path.isdir(args.model) else None
    if local is not None:
        resolve_class_ids(classes, *local)
    stems = [f"{i:03d}-{slugify(c)}-seed{args.seed}-{args.attention}" for i, c in enumerate(classes)]
    plans = plan_outputs(args.output_dir, stems, "png", args.overwrite)

    import torch

    from .dit import MHLADiTPipeline

    device, dtype = _device_and_dtype(args)
    pipe = _load_pipeline(MHLADiTPipeline, args, dtype)
    ids = pipe.class_ids(classes)
    pipe.to(device)
    attention = pipe.softmax_attention() if args.attention == "sdpa" else nullcontext()
    started = time.perf_counter()
    with attention:
        images = pipe(
            class_labels=ids, guidance_scale=args.guidance_scale, num_inference_steps=args.steps,
            generator=torch.Generator("cpu").manual_seed(args.seed), output_type="np",
        ).images
    wall = time.perf_counter() - started
    for name, class_id, image, plan in zip(classes, ids, images, plans):
        save_image(image, plan)
        write_settings(plan, _settings(
            args, pipe, device, dtype, task="class-to-image", class_name=name, class_id=class_id,
            batch_size=len(ids), output=str(plan.media), wall_time_s=round(wall, 3),
        ))
        print(f"{plan.media}  (class {class_id})")
    print(f"{len(ids)} image(s) in {wall:.2f} s ({args.attention})")
    return 0


def _run_import_wan(args: argparse.Namespace) -> int:
    from ..cli import _sizes
    from ..conversion import get_mhla_conversion
    from ..original_format import load_original_wan
    from ..weights import save_mhla

    if args.output.exists() and any(args.output.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{args.output} is not empty; choose another --output or pass --overwrite")
    layout = _sizes(args.layout) if args.layout else None
    started = time.perf_counter()
    transformer = load_original_wan(args.checkpoint, layout=layout, attention_head_dim=args.attention_head_dim)
    conversion = get_mhla_conversion(transformer)
    if conversion is None:
        transformer.save_pretrained(args.output)
        print(f"plain Wan checkpoint (no MHLA keys) -> {args.output}")
    else:
        save_mhla(transformer, args.output, include_base=True, overwrite=args.overwrite)
        print(conversion.summary())
        print(f"-> {args.output}")
    print(f"wall time {time.perf_counter() - started:.2f} s")
    return 0
