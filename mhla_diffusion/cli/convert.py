"""``mhla convert``: convert a Wan / DiT transformer's self-attention to MHLA and print what changed."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..models.families import FAMILIES, family_named
from ..utils.geometry import ImageGeometry, VideoGeometry, image_token_grid, video_token_grid
from ..utils.options import between, number
from .arguments import WAN_480P, add_command, parse_layers, parse_layout, parse_sizes

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "convert",
        configure,
        help="convert a Wan / DiT transformer's self-attention to MHLA and print what changed",
        description="Convert the softmax self-attention of a Diffusers Wan (2.1, 2.2) or DiT transformer to MHLA, "
        "report the changed layers and the output change on a random input, and optionally save the result. "
        "A pipeline folder with two transformers (Wan2.2-A14B: transformer, transformer_2) converts both with "
        "the same options and saves them to --output/transformer and --output/transformer_2.",
    )


#: A dropout probability in [0, 1) (an ``argparse`` type).
_probability = number(float, between(0, 1, high_open=True, zero="no dropout"))


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="Diffusers transformer or pipeline folder, or hub id (both transformers of a "
        "Wan2.2-A14B pipeline are converted)",
    )
    src.add_argument(
        "--tiny", choices=tuple(FAMILIES), help="build a tiny model from a config instead (demo, no download)"
    )
    p.add_argument(
        "--subfolder",
        help="subfolder of --model holding the transformer (default: 'transformer' for "
        "pipelines, and 'transformer_2' too where there is one)",
    )
    p.add_argument(
        "--preset",
        choices=("paper", "released-wan", "released-wan-ungated", "released-dit"),
        default="paper",
        help="paper: denominator (default); released-wan: no denominator, per-head output RMSNorm, "
        "SiLU gate, 3x5x10 blocks; released-wan-ungated: the same without the gate; released-dit (DiT "
        "only): the released MHLA4DiT: input LayerNorm, scalar-mixed denominator, LePE, output dropout "
        "0.1, blocks that divide the token grid (4x4 blocks on a 16x16 grid)",
    )
    p.add_argument("--layers", type=parse_layers, help="all (default), hybrid (2/3 of the blocks) or indices 1,2,4")
    p.add_argument("--layout", type=parse_layout, help="blocks per token-grid axis, e.g. 3x5x10, or 'auto' (default)")
    grid = p.add_mutually_exclusive_group()
    grid.add_argument("--target-grid", type=parse_sizes, help="token grid for the auto layout, e.g. 21x30x52")
    grid.add_argument(
        "--target-size",
        type=parse_sizes,
        help="pixel size for the auto layout, turned into tokens with the model's own VAE and patch "
        "factors (a pipeline folder's vae/; Wan2.1's for a transformer folder): FRAMESxHEIGHTxWIDTH "
        f"for Wan (default {'x'.join(map(str, FAMILIES['wan'].default_size))}), HEIGHTxWIDTH for DiT (default: the "
        "model's sample size)",
    )
    p.add_argument(
        "--transform", choices=("linear", "cos", "exp", "gaussian", "local"), help="mixing init (default linear)"
    )
    p.add_argument(
        "--mixing-normalization", choices=("column", "row"), help="column (reference code, default) or row (paper)"
    )
    p.add_argument(
        "--normalization",
        choices=("denominator", "none", "scalar_mixed_denominator"),
        help="override the preset's normalisation (scalar_mixed_denominator: released DiT's, needs a "
        "layout that divides the token grid)",
    )
    p.add_argument(
        "--input-norm",
        action="store_true",
        default=None,
        help="LayerNorm of the attention input before the q/k/v projections (released DiT)",
    )
    p.add_argument(
        "--output-dropout", type=_probability, help="dropout on the attention output in training (released DiT: 0.1)"
    )
    p.add_argument("--per-head-mixing", action="store_true", help="one mixing matrix per attention head")
    p.add_argument("--output-norm", action="store_true", default=None, help="per-head output RMSNorm")
    p.add_argument("--gate", action="store_true", default=None, help="SiLU output gate")
    p.add_argument("--lepe", action="store_true", default=None, help="depthwise LePE convolution of v")
    p.add_argument("--output", type=Path, help="save the MHLA weights (and config) to this folder")
    p.add_argument(
        "--include-base", action="store_true", help="save the whole converted transformer, not just MHLA weights"
    )
    p.add_argument("--overwrite", action="store_true", help="replace files already in --output")
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the before/after forward pass on a small random input",
    )
    p.set_defaults(func=run)


def _convert_config(
    args: argparse.Namespace, family: str | None, geometry: VideoGeometry | ImageGeometry | None = None
):
    """The :class:`MHLAConfig` of the options; ``geometry``: the loaded model's size rules (Wan2.1's or DiT-XL/2's
    until a model is loaded), which turn ``--target-size`` (and Wan's 480p default) into a token grid."""
    from ..config import MHLAConfig

    rules = None if family is None else _rules(family)
    if geometry is None and family is not None and family_named(family).geometry is not None:
        geometry = family_named(family).geometry()
    if rules is not None and args.preset in rules.refused_presets:
        raise ValueError(rules.refused_presets[args.preset])
    options: dict = {}
    if args.preset.startswith("released-wan"):
        options.update(MHLAConfig.released_wan(gate=args.preset == "released-wan").to_dict())
    if args.preset == "released-dit":
        options.update(MHLAConfig.released_dit().to_dict())
    if args.layers is not None:
        options["layers"] = args.layers
    if args.layout is not None:
        options["layout"] = args.layout
    if args.target_grid is not None:
        options["target_grid"] = args.target_grid
    if args.target_size is not None and rules is not None:
        size = "x".join(map(str, args.target_size))
        if rules.token_grid is None:
            label = family_named(family).label
            raise ValueError(f"--target-size needs Wan's or DiT's size rules; for {label} give --target-grid (tokens)")
        if len(args.target_size) != len(rules.size_example):
            example = "x".join(map(str, rules.size_example))
            raise ValueError(f"--target-size for {family_named(family).label} is {rules.size_format}, e.g. {example}")
        try:
            options["target_grid"] = rules.token_grid(geometry, args.target_size)
        except ValueError as error:
            raise ValueError(f"--target-size {size}: {error}") from None
    spec = None if family is None else family_named(family)
    if (
        spec is not None
        and not spec.fixed_grid
        and options.get("layout", "auto") == "auto"
        and "target_grid" not in options
    ):
        # the family's default grid (convert_to_mhla's rule), with this model's VAE; recorded in the saved config
        options["target_grid"] = spec.default_grid(geometry=geometry)
    if options.get("target_grid") is not None and "layout" not in options:
        options["layout"] = "auto"
    for name in (
        "transform",
        "mixing_normalization",
        "normalization",
        "output_norm",
        "gate",
        "lepe",
        "input_norm",
        "output_dropout",
    ):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    if args.per_head_mixing:
        options["per_head_mixing"] = True
    return MHLAConfig(**options)


def _video_grid(geometry: VideoGeometry, size: Sequence[int]) -> tuple[int, ...]:
    """Wan's token grid of a FRAMESxHEIGHTxWIDTH size: any size (the position bound is for generation, not
    for choosing a layout)."""
    scale = (geometry.vae_scale_temporal, geometry.vae_scale_spatial, geometry.vae_scale_spatial)
    return video_token_grid(*size, patch_size=geometry.patch_size, vae_scale=scale)


def _image_grid(geometry: ImageGeometry, size: Sequence[int]) -> tuple[int, ...]:
    """DiT's token grid of a HEIGHTxWIDTH size."""
    return image_token_grid(*size, patch_size=geometry.patch_size, vae_scale=geometry.vae_scale)


def _wan_inputs(cfg, layout: Sequence[int], equal_blocks: bool, g) -> tuple[Any, dict[str, Any]]:
    """Random Wan latents ``(1, C, F, H, W)`` of a 3x8x10 token grid (or the layout's, when larger) and the
    forward's other arguments: text embeddings, and image embeddings for an image-to-video transformer."""
    import torch

    pt, ph, pw = cfg.patch_size
    f, h, w = (max(n, b) for n, b in zip((3, 8, 10), layout))
    if equal_blocks:
        f, h, w = (-(-n // b) * b for n, b in zip((f, h, w), layout))
    latents = torch.randn(1, cfg.in_channels, f * pt, h * ph, w * pw, generator=g)
    if cfg.image_dim is None:
        text = torch.randn(1, 8, cfg.text_dim, generator=g)
        return latents, dict(timestep=torch.tensor([500]), encoder_hidden_states=text)
    # Wan2.1-I2V: image tokens too, and the 512 text tokens Diffusers' cross-attention expects after them
    from ..pipelines.wan_i2v import IMAGE_TEXT_TOKENS

    text = torch.randn(1, IMAGE_TEXT_TOKENS, cfg.text_dim, generator=g)
    pairs = cfg.pos_embed_seq_len  # FLF2V: first and last frame, one learned position per token
    image = torch.randn(*((2, pairs // 2) if pairs else (1, 4)), cfg.image_dim, generator=g)
    return latents, dict(timestep=torch.tensor([500]), encoder_hidden_states=text, encoder_hidden_states_image=image)


def _dit_inputs(cfg, layout: Sequence[int], equal_blocks: bool, g) -> tuple[Any, dict[str, Any]]:
    """Random DiT latents ``(1, C, H, W)`` at the model's sample size (a multiple of the layout's blocks with
    ``equal_blocks``) and the forward's timestep and class label."""
    import torch

    side, patch = cfg.sample_size, cfg.patch_size
    h = w = side
    if equal_blocks and any((side // patch) % b for b in layout):
        h, w = ((-(-(side // patch) // b) * b) * patch for b in layout)
    latents = torch.randn(1, cfg.in_channels, h, w, generator=g)
    return latents, dict(timestep=torch.tensor([500]), class_labels=torch.tensor([1]))


@dataclass(frozen=True)
class _FamilyRules:
    """What ``mhla convert`` does per model family (:data:`~mhla_diffusion.models.families.FAMILIES`)."""

    #: How ``--target-size`` is written for the family, and an example size.
    size_format: str
    size_example: tuple[int, ...]
    #: Pixel size -> token grid, with the model's geometry (``None``: the family has no size rules of ours).
    token_grid: Callable[[Any, Sequence[int]], tuple[int, ...]] | None
    #: ``(transformer config, layout, equal_blocks, generator)`` -> (latents, forward kwargs) of the before/after check.
    random_inputs: Callable[..., tuple[Any, dict[str, Any]]]
    #: ``--preset`` values refused for the family, with their messages.
    refused_presets: dict[str, str]
    #: Printed when a transformer folder has no ``vae/config.json`` beside it and a size becomes tokens.
    without_vae: str | None


_RULES: dict[str, _FamilyRules] = {
    "wan": _FamilyRules(
        size_format="FRAMESxHEIGHTxWIDTH",
        size_example=WAN_480P,
        token_grid=_video_grid,
        random_inputs=_wan_inputs,
        refused_presets={
            "released-dit": "--preset released-dit is the released DiT-MHLA setting, for DiT models; "
            "use --preset released-wan (or paper) for Wan"
        },
        without_vae="note: no vae/config.json beside the transformer: sizes become tokens with Wan2.1's VAE factors "
        "(x4 in time, x8 in space); for Wan2.2-TI2V-5B (x16) give the pipeline folder or --target-grid",
    ),
    "dit": _FamilyRules(
        size_format="HEIGHTxWIDTH",
        size_example=(256, 256),
        token_grid=_image_grid,
        random_inputs=_dit_inputs,
        refused_presets={},
        without_vae=None,
    ),
}


def _stock_family_inputs(family: str) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """The before/after check's input of a family converted through its stock Diffusers classes: random
    inputs from the transformer's config on a token grid of one token per block."""

    def inputs(cfg, layout: Sequence[int], equal_blocks: bool, g) -> tuple[Any, dict[str, Any]]:
        from ..models.tiny_families import tiny_family_inputs

        kwargs = tiny_family_inputs(family, tuple(layout), batch=1, seed=int(g.initial_seed()), config=cfg)
        return kwargs.pop("hidden_states"), kwargs

    return inputs


def _rules(family: str) -> _FamilyRules:
    """What ``mhla convert`` does for ``family``: its row of :data:`_RULES`, or the stock-pipeline families' rules."""
    if family in _RULES:
        return _RULES[family]
    axes = len(family_named(family).grid_axes)
    return _FamilyRules(
        size_format="a token grid (--target-grid)",
        size_example=(1,) * axes,
        token_grid=None,
        random_inputs=_stock_family_inputs(family),
        refused_presets={},
        without_vae=None,
    )


def _random_inputs(transformer, family: str, layout: Sequence[int], equal_blocks: bool = False):
    """A small random input for the before/after check (fixed seed), with a token grid >= the layout
    (a multiple of it with ``equal_blocks``, which the scalar-mixed denominator needs), on the model's device
    (floating-point tensors in its dtype)."""
    import torch

    parameter = next(transformer.parameters())
    latents, kwargs = _rules(family).random_inputs(
        transformer.config, layout, equal_blocks, torch.Generator().manual_seed(0)
    )

    def place(value: Any) -> Any:
        if isinstance(value, tuple):  # RoPE tables
            return tuple(place(table) for table in value)
        if not isinstance(value, torch.Tensor):  # sizes
            return value
        if value.is_floating_point():
            return value.to(parameter.device, parameter.dtype)
        return value.to(parameter.device)

    return place(latents), {name: place(value) for name, value in kwargs.items()}


def _transformer_plans(args: argparse.Namespace, plan: Any) -> dict[str, Any]:
    """``{name: plan}`` of the transformers of ``--model`` to convert (``plan``: its
    :class:`~mhla_diffusion.loaders.plan.LoadPlan`): both of a two-transformer pipeline (``transformer``,
    ``transformer_2``), else the one :func:`load_transformer` finds (``--subfolder``'s, or the pipeline's)."""
    if args.subfolder is not None:
        return {args.subfolder: plan.subplan(args.subfolder)}
    if plan.form == "pipeline" and len(plan.components) > 1:
        return dict(plan.components)
    return {"transformer": plan}


def _convert_one(transformer, config, args: argparse.Namespace):
    """Convert ``transformer`` with ``config``; print its layers and, unless ``--no-check``, the output change."""
    import torch

    from ..models.conversion import convert_to_mhla, model_family, resolve_mhla_config

    family = model_family(transformer)
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
        print(
            f"output change on a random {'x'.join(map(str, latents.shape))} latent: "
            f"max |diff| {change.abs().max().item():.4g}, relative L2 {relative.item():.4g} "
            "(MHLA before fine-tuning vs the softmax original)"
        )
    return conversion


def run(args: argparse.Namespace) -> int:
    from ..loaders.plan import resolve_source
    from ..loaders.weights import load_transformer, read_mhla_config, save_mhla
    from ..models.conversion import model_family, resolve_mhla_config
    from ..pipelines.mhla_mixin import TRANSFORMER_COMPONENTS

    started = time.perf_counter()
    # Validate what can be validated before loading a (possibly large) model.
    _convert_config(args, args.tiny)
    if args.output is not None and not args.overwrite:
        taken = [
            str(path)
            for path in (args.output, *(args.output / name for name in TRANSFORMER_COMPONENTS))
            if path.is_dir() and read_mhla_config(path) is not None
        ]
        if taken:
            raise FileExistsError(
                f"{args.output} already holds MHLA weights ({', '.join(taken)}); choose another "
                "--output or pass --overwrite"
            )

    vae_config = None
    if args.tiny is not None:
        tiny = family_named(args.tiny)
        loaders, source = {"transformer": tiny.tiny_transformer}, f"tiny {tiny.label} (built from a config)"
    else:
        # one transformer in memory at a time: Wan2.2-A14B's two are 14B parameters each
        plan = resolve_source(args.model)  # what --model is, read once
        loaders = {
            name: lambda part=part: load_transformer(part) for name, part in _transformer_plans(args, plan).items()
        }
        source = args.model
        vae_config = plan.component_config("vae") if plan.form == "pipeline" else None
    two = len(loaders) > 1
    config = None
    for name, load in loaders.items():
        transformer = load().eval()
        family = model_family(transformer)
        if config is None:  # from the first transformer: a pipeline's transformers share their architecture
            spec = family_named(family)
            geometry = None if spec.geometry is None else spec.geometry.from_configs(transformer.config, vae_config)
            uses_size = args.target_size is not None or (args.layout in (None, "auto") and args.target_grid is None)
            note = _rules(family).without_vae
            if note is not None and vae_config is None and uses_size and args.tiny is None:
                print(note)
            config = _convert_config(args, family, geometry)
        resolve_mhla_config(transformer, config)  # any config error before work on this transformer
        print(
            f"model: {f'{name} of ' if two else ''}{source} -> {type(transformer).__name__}, "
            f"{sum(p.numel() for p in transformer.parameters()):,} parameters"
        )
        _convert_one(transformer, config, args)
        if args.output is not None:  # a two-transformer pipeline: one folder per transformer, as the pipeline's
            folder = save_mhla(
                transformer,
                args.output / name if two else args.output,
                include_base=args.include_base,
                overwrite=args.overwrite,
            )
            print(
                f"saved {'converted transformer' if args.include_base else 'MHLA weights'} to {folder}: "
                + ", ".join(sorted(p.name for p in folder.iterdir()))
            )
        del transformer
    print(f"wall time {time.perf_counter() - started:.2f} s")
    return 0
