"""The model families MHLA supports, in one table: per family its Diffusers transformer class, the
MHLA-preserving transformer class, the pipeline classes, the size rules (geometry), the attention
processor and where its self-attention layers are.

Every place that asks "Wan or DiT?" asks this registry. Classes are named by module and attribute and
imported when asked for, so the table itself needs no torch (the command line reads it before loading
anything).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..utils.geometry import ImageGeometry, VideoGeometry

__all__ = ["FAMILIES", "ModelFamily", "family_for_class_name", "family_named", "family_of"]


def _load(path: str) -> Any:
    """The object ``"package.module:attribute"`` names."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its classes (named, imported on use), size rules and token-grid axes."""

    name: str
    #: How messages name the family ("Wan", "DiT").
    label: str
    #: The Diffusers transformer class; also its ``_class_name`` in ``config.json``.
    transformer_class_name: str
    #: Other ``_class_name`` values that mean this family's transformer (hub DiT checkpoints record the legacy one).
    legacy_class_names: tuple[str, ...]
    mhla_transformer_path: str
    processor_path: str
    pipeline_paths: tuple[str, ...]
    #: The builder of a tiny transformer of this family (:mod:`mhla_diffusion.models.tiny`).
    tiny_path: str
    geometry: type[VideoGeometry] | type[ImageGeometry]
    #: The token-grid axes a block layout has, in order.
    grid_axes: tuple[str, ...]
    #: The attribute holding the transformer blocks (each with its self-attention ``attn1``).
    blocks_attribute: str
    #: Whether the model is made for one image size (its config's ``sample_size``), which fixes its token grid.
    fixed_grid: bool

    @property
    def class_names(self) -> tuple[str, ...]:
        """Every ``_class_name`` a ``config.json`` of this family may record: Diffusers', legacy, MHLA's."""
        return (self.transformer_class_name, *self.legacy_class_names, self.mhla_transformer_path.split(":")[1])

    def transformer_class(self) -> type:
        """The Diffusers transformer class (``WanTransformer3DModel`` / ``DiTTransformer2DModel``)."""
        return _load(f"diffusers:{self.transformer_class_name}")

    def mhla_transformer_class(self) -> type:
        """The transformer class whose ``from_pretrained`` restores MHLA layers."""
        return _load(self.mhla_transformer_path)

    def processor_class(self) -> type:
        """The MHLA attention processor of this family's self-attention layers."""
        return _load(self.processor_path)

    def tiny_transformer(self, **kwargs: Any) -> Any:
        """A tiny randomly initialised transformer of this family (``mhla convert --tiny``, tests)."""
        return _load(self.tiny_path)(**kwargs)

    def pipeline_classes(self) -> tuple[type, ...]:
        """The MHLA pipeline classes of this family (the first: its basic text- or class-to-sample pipeline)."""
        return tuple(_load(path) for path in self.pipeline_paths)

    def patch_grid(self, transformer_config: Any) -> tuple[int, ...]:
        """The patch size per token-grid axis of a transformer with ``transformer_config``."""
        patch = self.geometry.from_configs(transformer_config).patch_size
        return tuple(patch) if isinstance(patch, tuple) else (patch,) * len(self.grid_axes)


FAMILIES: dict[str, ModelFamily] = {
    "wan": ModelFamily(
        name="wan",
        label="Wan",
        transformer_class_name="WanTransformer3DModel",
        legacy_class_names=(),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLAWanTransformer3DModel",
        processor_path="mhla_diffusion.models.processors.wan:WanMHLAProcessor",
        pipeline_paths=(
            "mhla_diffusion.pipelines.wan:MHLAWanPipeline",
            "mhla_diffusion.pipelines.wan_i2v:MHLAWanImageToVideoPipeline",
        ),
        tiny_path="mhla_diffusion.models.tiny:tiny_wan_transformer",
        geometry=VideoGeometry,
        grid_axes=("frames", "height", "width"),
        blocks_attribute="blocks",
        fixed_grid=False,
    ),
    "dit": ModelFamily(
        name="dit",
        label="DiT",
        transformer_class_name="DiTTransformer2DModel",
        legacy_class_names=("Transformer2DModel",),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLADiTTransformer2DModel",
        processor_path="mhla_diffusion.models.processors.dit:DiTMHLAProcessor",
        pipeline_paths=("mhla_diffusion.pipelines.dit:MHLADiTPipeline",),
        tiny_path="mhla_diffusion.models.tiny:tiny_dit_transformer",
        geometry=ImageGeometry,
        grid_axes=("rows", "columns"),
        blocks_attribute="transformer_blocks",
        fixed_grid=True,
    ),
}


def family_named(name: str) -> ModelFamily:
    """The family called ``name`` (``"wan"`` or ``"dit"``), or a ``ValueError`` naming the choices."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected {' or '.join(map(repr, FAMILIES))}")
    return FAMILIES[name]


def family_of(transformer: Any) -> ModelFamily:
    """The family of a transformer instance (a Diffusers Wan or DiT transformer, or a subclass)."""
    for family in FAMILIES.values():
        if isinstance(transformer, family.transformer_class()):
            return family
    supported = " and ".join(f.transformer_class_name for f in FAMILIES.values())
    raise TypeError(f"MHLA supports Diffusers' {supported}, got {type(transformer).__name__}")


def family_for_class_name(class_name: str | None) -> ModelFamily | None:
    """The family whose transformer a ``config.json`` ``_class_name`` names (legacy names and the MHLA classes
    too), else ``None``."""
    return next((f for f in FAMILIES.values() if class_name in f.class_names), None)
