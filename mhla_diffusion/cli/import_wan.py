"""``mhla import-wan``: an original-format Wan (+MHLA) checkpoint as a Diffusers transformer folder."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .arguments import add_command, parse_sizes

__all__ = ["check_output_free", "register", "save_imported"]


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
    from ..original_format import load_original_wan

    check_output_free(args.output, args.overwrite)
    started = time.perf_counter()
    transformer = load_original_wan(args.checkpoint, layout=args.layout, attention_head_dim=args.attention_head_dim)
    save_imported(transformer, args.output, args.overwrite, "plain Wan checkpoint (no MHLA keys)")
    print(f"wall time {time.perf_counter() - started:.2f} s")
    return 0


def check_output_free(output: Path, overwrite: bool) -> None:
    """Refuse an ``--output`` that is a file or a non-empty folder, unless ``--overwrite``."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise FileExistsError(f"{output} is not an empty folder; choose another --output or pass --overwrite")


def save_imported(transformer, output: Path, overwrite: bool, plain: str) -> None:
    """Save an imported transformer: the whole MHLA model with its config, or a plain Diffusers folder."""
    from ..conversion import get_mhla_conversion
    from ..weights import MHLA_CONFIG_NAME, save_mhla

    conversion = get_mhla_conversion(transformer)
    if conversion is None:
        stale = output / MHLA_CONFIG_NAME  # from an earlier MHLA import: it would mislabel this folder
        if stale.exists():
            stale.unlink()
            print(f"removed {stale} of the folder's previous contents")
        transformer.save_pretrained(output)
        print(f"{plain} -> {output}")
    else:
        save_mhla(transformer, output, include_base=True, overwrite=overwrite)
        print(conversion.summary())
        print(f"-> {output}")
