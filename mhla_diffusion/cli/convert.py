"""``mhla convert``: convert a Wan / DiT transformer's self-attention to MHLA and print what changed."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

from .arguments import WAN_480P, add_command, parse_layers, parse_sizes

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers, "convert", configure,
        help="convert a Wan / DiT transformer's self-attention to MHLA and print what changed",
        description="Convert the softmax self-attention of a Diffusers Wan2.1 or DiT transformer to MHLA, "
        "report the changed layers and the output change on a random input, and optionally save the result.",
    )


def parse_layout(text: str) -> str | tuple[int, ...]:
    """``auto`` or blocks per axis such as ``3x5x10`` (an ``argparse`` type)."""
    return "auto" if text == "auto" else parse_sizes(text)


def _probability(text: str) -> float:
    """A dropout probability in [0, 1) (an ``argparse`` type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability such as 0.1, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text!r}")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Diffusers transformer or pipeline folder, or hub id")
    src.add_argument("--tiny", choices=("wan", "dit"), help="build a tiny model from a config instead (demo, no download)")
    p.add_argument("--subfolder", help="subfolder of --model holding the transformer (default: 'transformer' for pipelines)")
    p.add_argument("--preset", choices=("paper", "released-wan", "released-wan-ungated", "released-dit"), default="paper",
                   help="paper: denominator (default); released-wan: no denominator, per-head output RMSNorm, "
                   "SiLU gate, 3x5x10 blocks; released-wan-ungated: the same without the gate; released-dit (DiT "
                   "only): the released MHLA4DiT: input LayerNorm, scalar-mixed denominator, LePE, output dropout "
                   "0.1, blocks that divide the token grid (4x4 blocks on a 16x16 grid)")
    p.add_argument("--layers", type=parse_layers, help="all (default), hybrid (2/3 of the blocks) or indices 1,2,4")
    p.add_argument("--layout", type=parse_layout, help="blocks per token-grid axis, e.g. 3x5x10, or 'auto' (default)")
    grid = p.add_mutually_exclusive_group()
    grid.add_argument("--target-grid", type=parse_sizes, help="token grid for the auto layout, e.g. 21x30x52")
    grid.add_argument("--target-size", type=parse_sizes,
                      help="pixel size for the auto layout: FRAMESxHEIGHTxWIDTH for Wan (default "
                      f"{'x'.join(map(str, WAN_480P))}), HEIGHTxWIDTH for DiT (default: the model's sample size)")
    p.add_argument("--transform", choices=("linear", "cos", "exp", "gaussian", "local"), help="mixing init (default linear)")
    p.add_argument("--mixing-normalization", choices=("column", "row"), help="column (reference code, default) or row (paper)")
    p.add_argument("--normalization", choices=("denominator", "none", "scalar_mixed_denominator"),
                   help="override the preset's normalisation (scalar_mixed_denominator: released DiT's, needs a "
                   "layout that divides the token grid)")
    p.add_argument("--input-norm", action="store_true", default=None,
                   help="LayerNorm of the attention input before the q/k/v projections (released DiT)")
    p.add_argument("--output-dropout", type=_probability, help="dropout on the attention output in training (released DiT: 0.1)")
    p.add_argument("--per-head-mixing", action="store_true", help="one mixing matrix per attention head")
    p.add_argument("--output-norm", action="store_true", default=None, help="per-head output RMSNorm")
    p.add_argument("--gate", action="store_true", default=None, help="SiLU output gate")
    p.add_argument("--lepe", action="store_true", default=None, help="depthwise LePE convolution of v")
    p.add_argument("--output", type=Path, help="save the MHLA weights (and config) to this folder")
    p.add_argument("--include-base", action="store_true", help="save the whole converted transformer, not just MHLA weights")
    p.add_argument("--overwrite", action="store_true", help="replace files already in --output")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the before/after forward pass on a small random input")
    p.set_defaults(func=run)


def _convert_config(args: argparse.Namespace, family: str | None, patch_size: Sequence[int] | None = None):
    from ..config import MHLAConfig
    from ..geometry import VideoGeometry, image_token_grid, video_token_grid

    patch_size = VideoGeometry.patch_size if patch_size is None else patch_size  # Wan2.1's until a model is loaded

    options: dict = {}
    if args.preset.startswith("released-wan"):
        options.update(MHLAConfig.released_wan(gate=args.preset == "released-wan").to_dict())
    if args.preset == "released-dit":
        if family == "wan":
            raise ValueError("--preset released-dit is the released DiT-MHLA setting, for DiT models; "
                             "use --preset released-wan (or paper) for Wan")
        options.update(MHLAConfig.released_dit().to_dict())
    if args.layers is not None:
        options["layers"] = args.layers
    if args.layout is not None:
        options["layout"] = args.layout
    if args.target_grid is not None:
        options["target_grid"] = args.target_grid
    if args.target_size is not None and family is not None:
        size = "x".join(map(str, args.target_size))
        if family == "wan" and len(args.target_size) != 3:
            raise ValueError(f"--target-size for Wan is FRAMESxHEIGHTxWIDTH, e.g. {'x'.join(map(str, WAN_480P))}")
        if family == "dit" and len(args.target_size) != 2:
            raise ValueError("--target-size for DiT is HEIGHTxWIDTH, e.g. 256x256")
        try:
            options["target_grid"] = (video_token_grid(*args.target_size, patch_size=patch_size) if family == "wan"
                                      else image_token_grid(*args.target_size, patch_size=patch_size[0]))
        except ValueError as error:
            raise ValueError(f"--target-size {size}: {error}") from None
    if family == "wan" and options.get("layout", "auto") == "auto" and "target_grid" not in options:
        options["target_grid"] = video_token_grid(*WAN_480P, patch_size=patch_size)
    if options.get("target_grid") is not None and "layout" not in options:
        options["layout"] = "auto"
    for name in ("transform", "mixing_normalization", "normalization", "output_norm", "gate", "lepe", "input_norm",
                 "output_dropout"):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.per_head_mixing:
        options["per_head_mixing"] = True
    return MHLAConfig(**options)


def _random_inputs(transformer, family: str, layout: Sequence[int], equal_blocks: bool = False):
    """A small random input for the before/after check (fixed seed), with a token grid >= the layout
    (a multiple of it with ``equal_blocks``, which the scalar-mixed denominator needs)."""
    import torch

    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    dtype = next(transformer.parameters()).dtype
    device = next(transformer.parameters()).device
    if family == "wan":
        pt, ph, pw = cfg.patch_size
        f, h, w = (max(n, b) for n, b in zip((3, 8, 10), layout))
        if equal_blocks:
            f, h, w = (-(-n // b) * b for n, b in zip((f, h, w), layout))
        latents = torch.randn(1, cfg.in_channels, f * pt, h * ph, w * pw, generator=g)
        text = torch.randn(1, 8, cfg.text_dim, generator=g)
        kwargs = dict(timestep=torch.tensor([500]), encoder_hidden_states=text.to(device, dtype))
    else:
        side, patch = cfg.sample_size, cfg.patch_size
        h = w = side
        if equal_blocks and any((side // patch) % b for b in layout):
            h, w = ((-(-(side // patch) // b) * b) * patch for b in layout)
        latents = torch.randn(1, cfg.in_channels, h, w, generator=g)
        kwargs = dict(timestep=torch.tensor([500]), class_labels=torch.tensor([1]))
    return latents.to(device, dtype), {k: v.to(device) for k, v in kwargs.items()}


def run(args: argparse.Namespace) -> int:
    import torch

    from ..conversion import convert_to_mhla, model_family, resolve_mhla_config
    from ..weights import MHLA_CONFIG_NAME, load_transformer, save_mhla

    started = time.perf_counter()
    # Validate what can be validated before loading a (possibly large) model.
    _convert_config(args, args.tiny)
    if args.output is not None and not args.overwrite and (args.output / MHLA_CONFIG_NAME).exists():
        raise FileExistsError(f"{args.output} already holds MHLA weights; choose another --output or pass --overwrite")

    if args.tiny == "wan":
        from ..tiny import tiny_wan_transformer

        transformer, source = tiny_wan_transformer(), "tiny Wan (built from a config)"
    elif args.tiny == "dit":
        from ..tiny import tiny_dit_transformer

        transformer, source = tiny_dit_transformer(), "tiny DiT (built from a config)"
    else:
        transformer, source = load_transformer(args.model, subfolder=args.subfolder), args.model
    transformer.eval()
    family = model_family(transformer)
    patch = transformer.config.patch_size
    config = _convert_config(args, family, tuple(patch) if family == "wan" else (patch, patch))

    print(f"model: {source} -> {type(transformer).__name__}, "
          f"{sum(p.numel() for p in transformer.parameters()):,} parameters")
    resolved = resolve_mhla_config(transformer, config)  # the layout, and any config error, before any work
    if args.check:
        latents, kwargs = _random_inputs(
            transformer, family, resolved.layout, resolved.normalization == "scalar_mixed_denominator"
        )
        with torch.no_grad():
            before = transformer(latents, **kwargs).sample
    conversion = convert_to_mhla(transformer, config)
    print(conversion.summary())
    print(f"{'layer':<32} {'before':<22} {'after':<22} {'new params':>10}")
    modules = dict(transformer.named_modules())
    originals = transformer._mhla_original_processors
    for name in conversion.layer_names:
        processor = modules[name].processor
        count = sum(p.numel() for p in processor.parameters())
        print(f"{name:<32} {type(originals[name]).__name__:<22} {type(processor).__name__:<22} {count:>10,}")
    if args.check:
        with torch.no_grad():
            after = transformer(latents, **kwargs).sample
        change = (after - before).float()
        relative = change.norm() / before.float().norm().clamp_min(1e-12)
        print(f"output change on a random {'x'.join(map(str, latents.shape))} latent: "
              f"max |diff| {change.abs().max().item():.4g}, relative L2 {relative.item():.4g} "
              "(MHLA before fine-tuning vs the softmax original)")
    if args.output is not None:
        folder = save_mhla(transformer, args.output, include_base=args.include_base, overwrite=args.overwrite)
        print(f"saved {'converted transformer' if args.include_base else 'MHLA weights'} to {folder}: "
              + ", ".join(sorted(p.name for p in folder.iterdir())))
    print(f"wall time {time.perf_counter() - started:.2f} s")
    return 0
