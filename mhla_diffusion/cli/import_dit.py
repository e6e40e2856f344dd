"""``mhla import-dit``: an original DiT or released DiT-MHLA checkpoint as a Diffusers transformer folder."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .arguments import add_command, positive_int
from .import_wan import check_output_free, save_imported

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "import-dit",
        configure,
        help="convert an original DiT or DiT-MHLA checkpoint to a Diffusers transformer folder",
        description="Convert a checkpoint of the original DiT code (e.g. DiT-XL-2-256x256.pt, or a train.py "
        "checkpoint) or of the released DiT-MHLA model into a Diffusers DiT transformer folder; DiT-MHLA "
        "becomes MHLA layers with the released setting. Use the folder with class-to-image --transformer.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help=".pt, .pth or .safetensors file")
    p.add_argument("--output", type=Path, required=True, help="folder for the converted transformer")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument(
        "--model-size",
        metavar="NAME",
        help="DiT size the checkpoint was trained as: DiT-S/2 .. DiT-XL/8, DiT-L/2-half, "
        "DiT-L/2-half-small-head (gives the head count; default: the one size that fits the shapes)",
    )
    heads.add_argument("--num-heads", type=positive_int, help="attention heads, for a model outside the DiT size table")
    p.add_argument(
        "--image-size",
        type=positive_int,
        help="image size in pixels the model was trained for (checked against "
        "the checkpoint's pos_embed; latent = image / 8)",
    )
    p.add_argument(
        "--weights",
        choices=("ema", "model"),
        help="which weights of a train.py checkpoint (default: ema when the file has them)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace files already in --output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..loaders.original_dit import load_original_dit

    check_output_free(args.output, args.overwrite)
    started = time.perf_counter()
    transformer = load_original_dit(
        args.checkpoint,
        model_size=args.model_size,
        num_heads=args.num_heads,
        image_size=args.image_size,
        weights=args.weights,
    )
    config = transformer.config
    print(
        f"DiT: depth {config.num_layers}, hidden {config.num_attention_heads * config.attention_head_dim}, "
        f"{config.num_attention_heads} heads, patch {config.patch_size}, latent {config.sample_size}x"
        f"{config.sample_size}, {config.out_channels} output channels, {config.num_embeds_ada_norm} classes"
    )
    save_imported(transformer, args.output, args.overwrite, "original DiT checkpoint (no MHLA keys)")
    print(f"wall time {time.perf_counter() - started:.2f} s")
    return 0
