"""``mhla import-wan``: an original-format Wan (+MHLA) checkpoint as a Diffusers transformer folder."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .arguments import add_command, parse_sizes

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers, "import-wan", configure,
        help="convert an original-format Wan (+MHLA) checkpoint to a Diffusers transformer folder",
        description="Convert a checkpoint in the original Wan key format (e.g. the one released with the MHLA "
        "paper) into a Diffusers transformer folder with MHLA layers; use it with --transformer.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help=".safetensors, .pt or .pth file")
    p.add_argument("--output", type=Path, required=True, help="folder for the converted transformer")
    p.add_argument("--layout", type=parse_sizes, help="block layout of the MHLA layers, e.g. 3x5x10 (default for 150 blocks)")
    p.add_argument("--attention-head-dim", type=int, default=128, help="head dim (128 for every Wan2.1 size)")
    p.add_argument("--overwrite", action="store_true", help="replace files already in --output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..conversion import get_mhla_conversion
    from ..original_format import load_original_wan
    from ..weights import save_mhla

    if args.output.exists() and any(args.output.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{args.output} is not empty; choose another --output or pass --overwrite")
    started = time.perf_counter()
    transformer = load_original_wan(args.checkpoint, layout=args.layout, attention_head_dim=args.attention_head_dim)
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
