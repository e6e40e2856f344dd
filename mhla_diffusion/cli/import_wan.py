"""``mhla import-wan``: an original-format Wan (+MHLA) checkpoint as a Diffusers transformer folder."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..utils.choices import WEIGHT_DTYPES
from .arguments import add_command, parse_sizes, positive_int

__all__ = ["check_output_free", "register", "save_imported"]


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "import-wan",
        configure,
        help="convert an original-format Wan (+MHLA) checkpoint to a Diffusers transformer folder",
        description="Convert a checkpoint in the original Wan key format (e.g. the one released with the MHLA "
        "paper) into a Diffusers transformer folder with MHLA layers; use it with --transformer. Any Wan2.1 / "
        "Wan2.2 transformer imports (T2V 1.3B / 14B, I2V, FLF2V, TI2V-5B); its config is read off the tensors' "
        "shapes unless --config gives it. The file is memory-mapped, so the import holds one copy of the weights.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        type=Path,
        help=".safetensors, .pt or .pth file, or a sharded checkpoint's folder or .safetensors.index.json",
    )
    p.add_argument("--output", type=Path, required=True, help="folder for the converted transformer")
    p.add_argument(
        "--layout", type=parse_sizes, help="block layout of the MHLA layers, e.g. 3x5x10 (default for 150 blocks)"
    )
    p.add_argument(
        "--config",
        help="the model's WanTransformer3DModel config, checked against the checkpoint: a published "
        "name (Wan2.1-T2V-1.3B, Wan2.1-T2V-14B, Wan2.1-I2V-14B-480P, ...: mhla_diffusion/utils/wan_configs.py) "
        "or a config.json (default: read off the checkpoint's shapes, heads of 128)",
    )
    p.add_argument(
        "--attention-head-dim", type=positive_int, help="head dim (default 128, as every Wan model, or --config's)"
    )
    p.add_argument("--dtype", choices=WEIGHT_DTYPES, help="weights dtype (default: as stored in the checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace files already in --output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_output_free(args.output, args.overwrite)
    config = resolve_config(args.config) if args.config else None

    import torch

    from ..loaders.original_wan import load_original_wan

    started = time.perf_counter()
    transformer = load_original_wan(
        args.checkpoint,
        config=config,
        layout=args.layout,
        attention_head_dim=args.attention_head_dim,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
    )
    save_imported(transformer, args.output, args.overwrite, "plain Wan checkpoint (no MHLA keys)")
    print(f"wall time {time.perf_counter() - started:.2f} s")
    return 0


def resolve_config(spec: str) -> dict[str, Any]:
    """``--config``: a Diffusers ``config.json`` (a file, or a folder holding one) or a published config's name."""
    from ..utils.wan_configs import wan_transformer_config

    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"--config {path} is not JSON: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--config {path} holds no config object")
        return config
    try:
        return wan_transformer_config(spec)
    except ValueError as error:
        raise ValueError(f"--config {spec!r} is neither a config.json nor a published config: {error}") from None


def check_output_free(output: Path, overwrite: bool) -> None:
    """Refuse an ``--output`` that is a file or a non-empty folder, unless ``--overwrite``."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise FileExistsError(f"{output} is not an empty folder; choose another --output or pass --overwrite")


def save_imported(transformer, output: Path, overwrite: bool, plain: str) -> None:
    """Save an imported transformer: the whole MHLA model with its config, or a plain Diffusers folder."""
    from ..loaders.weights import MHLA_CONFIG_NAME, save_mhla
    from ..models.conversion import get_mhla_conversion

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
