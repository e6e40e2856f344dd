"""``mhla generate``: prompts to videos (or Flux images) with the stock Diffusers pipeline of SkyReels-V2,
HunyuanVideo, LTX-Video, CogVideoX, SANA-Video or Flux, its transformer loaded through the MHLA loader.

The transformer's MHLA comes from ``--mhla-weights`` (a ``save_mhla`` / ``mhla convert --output`` folder) or from
the pipeline folder itself (a ``transformer/`` saved whole with MHLA, as the text-to-video trainer's
``save_pipeline`` writes). Everything that needs no model is checked first: the pipeline's family from its
``model_index.json``, that the MHLA weights are of that family, the prompts and the output files. Sizes, steps and
guidance the command is not given are the pipeline's own defaults.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from typing import Any

from .arguments import add_command, add_model_arguments, non_negative_float, positive_int

__all__ = ["register"]

#: The families this command generates with (Wan and DiT have their own commands).
FAMILY_NAMES = ("skyreels-v2", "hunyuan-video", "ltx-video", "cogvideox", "sana-video", "flux")
#: The commands of the families that have one.
OWN_COMMANDS = {"wan": "mhla text-to-video (or image-to-video)", "dit": "mhla class-to-image"}


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "generate",
        configure,
        help="generate with the stock Diffusers pipeline of SkyReels-V2, HunyuanVideo, LTX-Video, CogVideoX, "
        "SANA-Video or Flux + MHLA",
        description="Generate videos (Flux: images) from prompts with a family's stock Diffusers pipeline, its "
        "transformer loaded with MHLA from --mhla-weights or from the pipeline folder itself. Sizes, steps and "
        "guidance default to the pipeline's own.",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers", embedded=False, family=None)
    parser.add_argument("--prompt", action="append", default=[], required=True, help="a prompt (repeat for several)")
    parser.add_argument("--negative-prompt", help="negative prompt, for the pipelines that take one")
    parser.add_argument("--num-frames", type=positive_int, help="frames of a video (default: the pipeline's)")
    parser.add_argument("--height", type=positive_int, help="pixels (default: the pipeline's)")
    parser.add_argument("--width", type=positive_int, help="pixels (default: the pipeline's)")
    parser.add_argument("--steps", type=positive_int, help="denoising steps (default: the pipeline's)")
    parser.add_argument("--guidance-scale", type=non_negative_float, help="guidance (default: the pipeline's)")
    parser.add_argument("--max-sequence-length", type=positive_int, help="text tokens (default: the pipeline's)")
    parser.add_argument("--fps", type=positive_int, default=16, help="frames per second of written videos (16)")
    parser.add_argument("--format", choices=("mp4", "gif", "frames"), default="mp4", help="videos: mp4, gif, frames")
    parser.set_defaults(func=run)


def _family_of_pipeline(model: str, plan: Any) -> Any:
    """The family of the transformer ``model``'s ``model_index.json`` names (``plan``: its
    :class:`~mhla_diffusion.loaders.plan.LoadPlan`; nothing loaded); a ``ValueError`` naming the right command for
    Wan / DiT and the families this command takes otherwise."""
    from ..models.families import FAMILIES, family_for_class_name

    if plan.form != "pipeline" or plan.index is None:
        raise ValueError(f"--model {model} is not a Diffusers pipeline (no model_index.json): it is {plan.describe()}")
    index = plan.index
    class_name = (index.get("transformer") or (None, None))[1]
    family = family_for_class_name(class_name)
    if family is not None and family.name in OWN_COMMANDS:
        raise ValueError(f"--model {model} is a {family.label} pipeline: generate with `{OWN_COMMANDS[family.name]}`")
    if family is None or family.name not in FAMILY_NAMES:
        names = ", ".join(FAMILIES[n].label for n in FAMILY_NAMES)
        raise ValueError(f"--model {model}'s transformer is a {class_name!r}; `mhla generate` takes {names}")
    return family


def _mhla_source(args: argparse.Namespace, family: Any, plan: Any) -> tuple[str | None, Any]:
    """Where the transformer's MHLA comes from (``"mhla_weights"``, ``"pipeline"`` or ``None``: softmax only) and
    the plan of --mhla-weights, with the weights' family checked against the pipeline's (``plan``: --model's)."""
    from ..loaders.plan import resolve_source

    if args.mhla_weights is not None:
        if not args.mhla_weights.is_dir():
            raise ValueError(f"--mhla-weights {args.mhla_weights} is not a folder: give a save_mhla folder")
        weights = resolve_source(args.mhla_weights)
        if weights.mhla is None:
            raise ValueError(
                f"--mhla-weights {args.mhla_weights} holds no MHLA setting (it is {weights.describe()}): give a "
                "save_mhla folder"
            )
        if weights.family != family.name:
            raise ValueError(
                f"--mhla-weights {args.mhla_weights} are for a {weights.family} transformer, but --model "
                f"{args.model} is a {family.label} pipeline"
            )
        return "mhla_weights", weights
    saved = plan.components.get("transformer")
    if saved is not None and saved.form == "transformer" and saved.mhla is not None:
        return "pipeline", None
    if args.attention == "mhla":
        raise ValueError(
            f"--attention mhla, but {args.model}'s transformer has no MHLA layers: pass --mhla-weights (a folder "
            "`mhla convert --output` wrote), a pipeline saved with MHLA, or --attention softmax"
        )
    return None, None


def _load(args: argparse.Namespace, plan: Any, source: str | None, weights: Any) -> tuple[Any, str, Any]:
    """The stock pipeline with its transformer loaded through the MHLA loader by --model's ``plan`` (and the
    --mhla-weights plan ``weights``); also the device and dtype."""
    from diffusers import DiffusionPipeline

    from ..loaders.loading import device_and_dtype
    from ..loaders.weights import load_mhla, load_transformer

    device, dtype = device_and_dtype(args.device, args.dtype)
    if source == "pipeline":
        transformer = load_mhla(plan.components["transformer"], dtype=dtype)
    else:
        transformer = load_transformer(plan, dtype=dtype)
        if source == "mhla_weights":
            load_mhla(weights, transformer)
    pipe = DiffusionPipeline.from_pretrained(args.model, transformer=transformer, dtype=dtype)
    return pipe.to(device), device, dtype


def run(args: argparse.Namespace) -> int:
    import torch

    from ..loaders.plan import resolve_source
    from ..models.conversion import softmax_attention
    from ..pipelines.outputs import plan_outputs, save_image, save_video, slugify, write_settings

    plan = resolve_source(args.model)  # what --model is, read once: every check and the load use it
    family = _family_of_pipeline(args.model, plan)
    source, weights = _mhla_source(args, family, plan)
    image = len(family.grid_axes) == 2
    if image and args.num_frames is not None:
        raise ValueError(f"--num-frames: {family.label} makes images; leave it out")
    fmt = "png" if image else args.format
    stems = [f"{i:03d}-{slugify(p)}-seed{args.seed}-{args.attention}" for i, p in enumerate(args.prompt)]
    plans = plan_outputs(args.output_dir, stems, fmt, args.overwrite)

    pipe, device, dtype = _load(args, plan, source, weights)
    given = {
        "num_frames": args.num_frames,
        "height": args.height,
        "width": args.width,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "negative_prompt": args.negative_prompt,
        "max_sequence_length": args.max_sequence_length,
    }
    call = {key: value for key, value in given.items() if value is not None}
    attention = softmax_attention(pipe.transformer) if args.attention == "softmax" and source else nullcontext()
    with attention:
        for index, (prompt, plan) in enumerate(zip(args.prompt, plans)):
            started = time.perf_counter()
            out = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(args.seed), output_type="np", **call)
            wall = time.perf_counter() - started
            if image:
                save_image(out.images[0], plan)
            else:
                save_video(out.frames[0], plan, fmt, args.fps)
            write_settings(
                plan,
                {
                    "task": "generate",
                    "family": family.name,
                    "pipeline": type(pipe).__name__,
                    "model": args.model,
                    "mhla_weights": str(args.mhla_weights) if args.mhla_weights else None,
                    "mhla_from": source,
                    "attention": args.attention,
                    "prompt": prompt,
                    "seed": args.seed,
                    **call,
                    **({} if image else {"fps": args.fps}),
                    "device": str(device),
                    "dtype": str(dtype).removeprefix("torch."),
                    "wall_time_s": round(wall, 3),
                    "output": str(plan.media),
                },
            )
            print(f"[{index + 1}/{len(args.prompt)}] {plan.media}  ({args.attention}, {wall:.2f} s)")
    return 0
