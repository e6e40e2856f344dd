"""Turn the softmax self-attention of a Diffusers Wan or DiT transformer into MHLA, in place."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from ..config import MHLAConfig
from ..ops.block_layout import auto_layout, num_blocks, validate_grid_layout
from ..utils.geometry import check_equal_blocks
from .families import family_of
from .processors.base import MHLAProcessor
from .processors.grid import TokenGridContext, install_grid_hook, remove_grid_hook

__all__ = [
    "MHLA_CONFIG_KEY",
    "MHLAConversion",
    "build_mhla_processors",
    "convert_to_mhla",
    "get_mhla_conversion",
    "install_mhla_processors",
    "mhla_parameter_names",
    "model_family",
    "resolve_mhla_config",
    "revert_mhla",
    "self_attention_layers",
    "softmax_attention",
    "sync_mhla_config",
]

logger = logging.getLogger(__name__)

#: The ``config.json`` entry (Diffusers' ``register_to_config``) that holds a converted transformer's resolved
#: :class:`MHLAConfig` as a dict; absent (or ``None``) while the transformer runs softmax attention.
MHLA_CONFIG_KEY = "mhla"


@dataclass
class MHLAConversion:
    """What :func:`convert_to_mhla` changed. ``config`` is resolved: explicit layers and layout.

    ``grid`` is the token grid the layout was chosen for (``layout="auto"``) or checked against: the config's
    ``target_grid``, else the family's default (:meth:`~mhla_diffusion.models.families.ModelFamily.default_grid`);
    ``None`` for an explicit layout with no grid to check. ``grid_origin`` says where it came from. Both tell how
    the conversion was made, not what it made: a model loaded from its saved folder (which records the resolved
    layout, not the grid) compares equal to the one converted in place.
    """

    family: str
    config: MHLAConfig
    layer_names: list[str]
    num_layers: int
    num_new_parameters: int
    grid: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)
    grid_origin: str | None = dataclasses.field(default=None, compare=False)

    @property
    def layers(self) -> list[int]:
        return list(self.config.layers)

    @property
    def layout(self) -> tuple[int, ...]:
        return tuple(self.config.layout)

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.layout)

    def summary(self) -> str:
        """A few human-readable lines."""
        cfg = self.config
        extras = [
            name
            for name, on in (
                ("input LayerNorm", cfg.input_norm),
                ("output RMSNorm", cfg.output_norm),
                ("gate", cfg.gate),
                ("LePE", cfg.lepe),
                (f"output dropout {cfg.output_dropout:g}", cfg.output_dropout > 0),
            )
            if on
        ]
        return "\n".join(
            [
                f"MHLA on {len(self.layer_names)} of {self.num_layers} self-attention layers ({self.family}): "
                + ", ".join(self.layer_names),
                f"block layout {'x'.join(map(str, self.layout))} = {self.num_blocks} blocks"
                + (f" for token grid {'x'.join(map(str, self.grid))} ({self.grid_origin})" if self.grid else "")
                + f", mixing init '{cfg.transform}' ({cfg.mixing_normalization}), "
                f"{'per-head' if cfg.per_head_mixing else 'shared'} "
                f"{'learnable' if cfg.learnable_mixing else 'frozen'} mixing",
                f"normalisation: {cfg.normalization}; extras: {', '.join(extras) or 'none'}",
                *(
                    [f"block-causal: window {cfg.causal_window} temporal rows, older rows folded by {cfg.causal_fold}"]
                    if cfg.causal
                    else []
                ),
                f"new parameters: {self.num_new_parameters:,}",
            ]
        )


def model_family(transformer: nn.Module) -> str:
    """``"wan"`` for ``WanTransformer3DModel``, ``"dit"`` for ``DiTTransformer2DModel`` (and subclasses):
    the name of its :mod:`~mhla_diffusion.models.families` entry."""
    return family_of(transformer).name


def self_attention_layers(transformer: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, attention module)`` of every block's self-attention (joint or not), in the family's site order
    (:attr:`~mhla_diffusion.models.families.ModelFamily.attention_sites`), then block order."""
    return [
        (f"{blocks}.{i}.{name}", getattr(block, name))
        for blocks, name in family_of(transformer).attention_sites
        for i, block in enumerate(getattr(transformer, blocks))
    ]


def _patch_size(transformer: nn.Module) -> tuple[int, ...]:
    """Patch size per token-grid axis: (t, h, w) for Wan, (h, w) for DiT (from the transformer's config)."""
    return family_of(transformer).patch_grid(transformer.config)


def _resolve_layers(spec: str | Sequence[int], total: int) -> list[int]:
    if spec == "all":
        return list(range(total))
    if spec == "hybrid":
        return [i for i in range(total) if i % 3 != 0]
    out_of_range = [i for i in spec if i >= total]
    if out_of_range:
        raise ValueError(f"`layers` {out_of_range} out of range: the transformer has {total} blocks (0..{total - 1})")
    return list(spec)


def _layout_grid(config: MHLAConfig, transformer: nn.Module) -> tuple[tuple[int, ...] | None, str | None]:
    """The token grid ``config``'s layout is chosen for (``auto``) or checked against, and where it comes from:
    ``target_grid``; else, for an ``auto`` layout or a family with a fixed grid (DiT), the family's default grid
    (:meth:`~mhla_diffusion.models.families.ModelFamily.default_grid` of the transformer's config); else none."""
    if config.target_grid is not None:
        return tuple(config.target_grid), "target_grid"
    family = family_of(transformer)
    if config.layout == "auto" or family.fixed_grid:
        return family.default_grid(transformer.config), family.default_grid_origin(transformer.config)
    return None, None


def _resolve_layout(config: MHLAConfig, transformer: nn.Module) -> tuple[int, ...]:
    family = family_of(transformer)
    axes, axis_names = len(family.grid_axes), f"({', '.join(family.grid_axes)})"
    target, _ = _layout_grid(config, transformer)
    equal_blocks = config.normalization == "scalar_mixed_denominator"  # needs a layout that divides the grid
    if target is not None and len(target) != axes:
        raise ValueError(f"`target_grid` {tuple(target)} must have {axes} axes {axis_names} for {family.name}")
    if config.layout == "auto":
        return auto_layout(target, equal_blocks=equal_blocks)
    layout = tuple(config.layout)
    if len(layout) != axes:
        raise ValueError(f"`layout` {layout} must have {axes} axes {axis_names} for {family.name}")
    if target is not None:
        validate_grid_layout(target, layout)
        if equal_blocks:
            what = (
                "`target_grid`"
                if config.target_grid is not None
                else "the model's token grid (sample_size // patch_size)"
            )
            check_equal_blocks(target, layout, what)
    return layout


def get_mhla_conversion(transformer: nn.Module) -> MHLAConversion | None:
    """The :class:`MHLAConversion` of the MHLA layers that run now, or ``None`` when none does.

    It follows the processors actually installed: ``None`` for a model never converted, reverted, inside
    :func:`softmax_attention`, or whose MHLA processors were all replaced by hand (e.g.
    ``transformer.set_attn_processor(WanAttnProcessor())``); when only some were replaced, the conversion of
    the layers that still run MHLA (what ``save_pretrained`` / :func:`save_mhla` then write).
    """
    conversion = getattr(transformer, "_mhla_conversion", None)
    if conversion is None:
        return None
    try:
        modules = [transformer.get_submodule(name) for name in conversion.layer_names]
    except AttributeError:  # a wrapper (FSDP, torch.compile) renames the paths: the recorded conversion, as it is
        return conversion
    running = [isinstance(getattr(module, "processor", None), MHLAProcessor) for module in modules]
    if all(running):
        return conversion
    if not any(running):
        return None
    kept = [i for i, runs in enumerate(running) if runs]
    return dataclasses.replace(
        conversion,
        config=dataclasses.replace(conversion.config, layers=[conversion.config.layers[i] for i in kept]),
        layer_names=[conversion.layer_names[i] for i in kept],
        num_new_parameters=sum(p.numel() for i in kept for p in modules[i].processor.parameters()),
    )


def resolve_mhla_config(transformer: nn.Module, config: MHLAConfig) -> MHLAConfig:
    """``config`` with explicit layer indices and block layout for ``transformer`` (``auto`` resolved)."""
    indices = _resolve_layers(config.layers, len(self_attention_layers(transformer)))
    return dataclasses.replace(config, layers=indices, layout=_resolve_layout(config, transformer))


def build_mhla_processors(
    transformer: nn.Module, config: MHLAConfig, grid_context: TokenGridContext | None = None, *, empty: bool = False
) -> tuple[MHLAConfig, dict[str, MHLAProcessor]]:
    """Resolve ``config`` for ``transformer`` and create (but do not install) one processor per chosen layer.

    Returns the resolved config and ``{layer name: processor}`` on the layers' device and dtype. With
    ``empty``, the processors' parameters are left on the meta device in the layers' dtype (nothing
    allocated or initialised), for a loader that fills them with ``load_state_dict(..., assign=True)``.
    """
    processor_class = family_of(transformer).processor_class()
    layers = self_attention_layers(transformer)
    resolved = resolve_mhla_config(transformer, config)
    indices, layout = resolved.layers, tuple(resolved.layout)
    context = grid_context if grid_context is not None else TokenGridContext()  # shared by this model's processors
    processors: dict[str, MHLAProcessor] = {}
    for i in indices:
        name, attn = layers[i]
        head_dim = attn.to_q.out_features // attn.heads
        weight = attn.to_q.weight
        # a model on the meta device (built without memory) gets meta parameters: none is allocated or initialised
        meta = empty or weight.is_meta
        with torch.device("meta") if meta else nullcontext():
            processor = processor_class(attn.heads, head_dim, layout, resolved, context)
        processors[name] = processor.to(device="meta" if meta else weight.device, dtype=weight.dtype)
    return resolved, processors


def convert_to_mhla(transformer: nn.Module, config: MHLAConfig | None = None) -> MHLAConversion:
    """Replace the chosen self-attention layers of a Wan or DiT transformer by MHLA, in place.

    Each chosen ``attn1`` gets its own processor module (owning the mixing and optional extras) and
    keeps its projections and q/k norms; cross-attention, FFNs and everything else are untouched. A
    forward pre-hook tells the processors the token grid on every call.

    ``config`` defaults to ``MHLAConfig()``, which converts every family: its ``auto`` layout is chosen for the
    config's ``target_grid``, else for the family's default grid (Wan: Wan2.1's 81x480x832 video with the
    transformer's patch size -> (21, 30, 52); DiT: ``sample_size / patch_size``; see
    :meth:`~mhla_diffusion.models.families.ModelFamily.default_grid`).

    Returns an :class:`MHLAConversion` that says which layers changed and which layout it chose for which token
    grid (also ``get_mhla_conversion``); the choice is logged at INFO level too.
    """
    config = config if config is not None else MHLAConfig()
    if get_mhla_conversion(transformer) is not None:
        raise ValueError("this transformer is already converted to MHLA; call revert_mhla(transformer) first")
    context = TokenGridContext()
    resolved, processors = build_mhla_processors(transformer, config, context)
    grid, origin = _layout_grid(config, transformer)
    conversion = install_mhla_processors(transformer, resolved, processors, context, grid=grid, grid_origin=origin)
    logger.info(
        "MHLA (%s): block layout %s%s",
        conversion.family,
        "x".join(map(str, conversion.layout)),
        f" ({'auto' if config.layout == 'auto' else 'given'}) for token grid {'x'.join(map(str, grid))} ({origin})"
        if grid is not None
        else " (given)",
    )
    return conversion


def install_mhla_processors(
    transformer: nn.Module,
    resolved: MHLAConfig,
    processors: dict[str, MHLAProcessor],
    context: TokenGridContext,
    *,
    grid: Sequence[int] | None = None,
    grid_origin: str | None = None,
) -> MHLAConversion:
    """Set processors made by :func:`build_mhla_processors` (sharing ``context``) and attach the grid hook;
    ``grid`` / ``grid_origin``: what the returned :class:`MHLAConversion` records as the layout's token grid."""
    modules = dict(transformer.named_modules())
    originals = {}
    install_grid_hook(transformer, family_of(transformer).grid_reader(transformer.config), context)
    if resolved.causal:  # a stream's frames run past Wan's rotary table
        from .streaming import install_frame_positions

        install_frame_positions(transformer)
    for name, processor in processors.items():
        attn = modules[name]
        originals[name] = attn.processor
        processor.train(attn.training)  # the layer's train / eval mode (output dropout is active in training only)
        attn.set_processor(processor)
    layers = self_attention_layers(transformer)
    conversion = MHLAConversion(
        family=model_family(transformer),
        config=resolved,
        layer_names=list(processors),
        num_layers=len(layers),
        num_new_parameters=sum(p.numel() for proc in processors.values() for p in proc.parameters()),
        grid=None if grid is None else tuple(grid),
        grid_origin=grid_origin,
    )
    transformer._mhla_conversion = conversion
    transformer._mhla_original_processors = originals
    sync_mhla_config(transformer)
    return conversion


def revert_mhla(transformer: nn.Module) -> None:
    """Undo :func:`convert_to_mhla`: restore the original processors (MHLA parameters are dropped)."""
    if get_mhla_conversion(transformer) is None:
        raise ValueError("this transformer is not converted to MHLA")
    modules = dict(transformer.named_modules())
    for name, processor in transformer._mhla_original_processors.items():
        modules[name].set_processor(processor)
    remove_grid_hook(transformer)
    del transformer._mhla_conversion
    del transformer._mhla_original_processors
    sync_mhla_config(transformer)


def sync_mhla_config(transformer: nn.Module) -> None:
    """Make the transformer's Diffusers config say what runs: its :data:`MHLA_CONFIG_KEY` entry holds the resolved
    config of :func:`get_mhla_conversion` (so ``save_pretrained`` writes it into ``config.json``), and is removed
    when no MHLA layer runs (``None`` in the MHLA transformer classes, whose ``__init__`` takes it)."""
    conversion = get_mhla_conversion(transformer)
    if conversion is not None:
        transformer.register_to_config(**{MHLA_CONFIG_KEY: conversion.config.to_dict()})
        return
    if transformer.config.get(MHLA_CONFIG_KEY) is None:
        return
    if MHLA_CONFIG_KEY in transformer._get_init_keys(type(transformer)):
        transformer.register_to_config(**{MHLA_CONFIG_KEY: None})
    else:  # Diffusers' FrozenDict has no deletion: replace it without the key
        kept = {key: value for key, value in transformer.config.items() if key != MHLA_CONFIG_KEY}
        transformer._internal_dict = type(transformer.config)(kept)


@contextmanager
def softmax_attention(transformer: nn.Module) -> Iterator[nn.Module]:
    """Run a converted transformer with its original softmax self-attention inside the block.

    The MHLA processors (and their parameters) are put back on exit, so one loaded model serves a
    side-by-side comparison. A transformer that is not converted is left as it is.
    """
    if get_mhla_conversion(transformer) is None:
        yield transformer
        return
    modules = dict(transformer.named_modules())
    mhla = {name: modules[name].processor for name in transformer._mhla_original_processors}
    try:
        for name, processor in transformer._mhla_original_processors.items():
            modules[name].set_processor(processor)
        yield transformer
    finally:
        for name, processor in mhla.items():
            modules[name].set_processor(processor)


def mhla_parameter_names(transformer: nn.Module) -> list[str]:
    """State-dict keys owned by MHLA processors (``<layer>.processor.<name>``)."""
    conversion = get_mhla_conversion(transformer)
    if conversion is None:
        return []
    prefixes = tuple(f"{name}.processor." for name in conversion.layer_names)
    return [key for key in transformer.state_dict() if key.startswith(prefixes)]
