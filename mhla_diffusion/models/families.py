"""The model families MHLA supports, in one table: per family its Diffusers transformer class, the
MHLA-preserving transformer class, the pipeline classes, the size rules (geometry), the attention
processor, where its self-attention layers are, and the token grid a default ``MHLAConfig()`` chooses its
block layout for (:meth:`ModelFamily.default_grid`).

Every place that asks "Wan or DiT?" asks this registry. Classes are named by module and attribute and
imported when asked for, so the table itself needs no torch (the command line reads it before loading
anything).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping

from ..utils.geometry import WAN_480P, ImageGeometry, VideoGeometry

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
    #: Size rules of the family's own pipelines (Wan, DiT); ``None`` where the stock Diffusers pipeline checks sizes.
    geometry: type[VideoGeometry] | type[ImageGeometry] | None
    #: The token-grid axes a block layout has, in order.
    grid_axes: tuple[str, ...]
    #: Where the self-attention layers are: ``(blocks attribute, attention attribute)`` per kind of block, in the
    #: order layer indices count them (Flux: its double-stream blocks, then its single-stream blocks).
    attention_sites: tuple[tuple[str, str], ...]
    #: Whether the model is made for one image size (its config's ``sample_size``), which fixes its token grid.
    fixed_grid: bool
    #: The family's published default sample size in pixels (Wan: frames, height, width), whose token grid the
    #: ``auto`` block layout is chosen for when the config gives no ``target_grid``; ``None`` for a
    #: :attr:`fixed_grid` family, whose grid is its config's ``sample_size / patch_size``
    #: (:meth:`default_grid`).
    default_size: tuple[int, ...] | None = None
    #: Or, for a family without :attr:`geometry`, the token grid of its published default size itself, and that
    #: size in pixels (frames, height, width or height, width) for messages.
    default_tokens: tuple[int, ...] | None = None
    default_pixels: tuple[int, ...] | None = None
    #: Where a forward call gives the token grid: ``"latents"`` ``(B, C, *sizes)``, ``"frames_first"``
    #: ``(B, F, C, H, W)``, ``"size_arguments"`` (``num_frames``, ``height``, ``width``) or ``"image_ids"``
    #: (``img_ids``); see :mod:`mhla_diffusion.models.processors.grid`.
    grid_source: str = "latents"
    #: Per grid axis, the transformer config key of its patch size, or a number (a missing or null key counts 1; a
    #: key holding a list gives several axes);
    #: ``None``: :attr:`geometry`'s patch size.
    patch_keys: tuple[str | int, ...] | None = None
    #: Self-attention over a joint sequence of image and text tokens (:mod:`mhla_diffusion.ops.joint`).
    joint: bool = False

    def __post_init__(self) -> None:
        defaults = (self.default_size is not None) + (self.default_tokens is not None) + self.fixed_grid
        if defaults != 1:
            raise ValueError(
                f"family {self.name!r}: give exactly one of `default_size`, `default_tokens`, `fixed_grid`"
            )

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
        if self.patch_keys is not None:
            config, patch = transformer_config or {}, []
            for key in self.patch_keys:
                value = key if isinstance(key, int) else config.get(key)
                if isinstance(value, (list, tuple)):
                    patch.extend(int(p) for p in value)
                else:
                    patch.append(int(value or 1))
            return tuple(patch)
        patch = self.geometry.from_configs(transformer_config).patch_size
        return tuple(patch) if isinstance(patch, tuple) else (patch,) * len(self.grid_axes)

    def grid_reader(self, transformer_config: Any) -> Any:
        """What reads a forward call's token grid for a transformer with ``transformer_config`` (the grid hook's)."""
        from .processors.grid import LatentGrid, PositionIdGrid, SizeArgumentGrid

        if self.grid_source == "image_ids":
            return PositionIdGrid()
        patch = self.patch_grid(transformer_config)
        if self.grid_source == "size_arguments":
            return SizeArgumentGrid(patch)
        return LatentGrid(patch, frames_first=self.grid_source == "frames_first")

    def default_grid(
        self, transformer_config: Mapping[str, Any] | None = None, geometry: VideoGeometry | None = None
    ) -> tuple[int, ...]:
        """The token grid the ``auto`` block layout is chosen for when ``MHLAConfig.target_grid`` is not given.

        * a :attr:`fixed_grid` family (DiT): ``sample_size // patch_size`` per axis of ``transformer_config``
          (DiT-XL/2 at 256 px: 32 // 2 -> (16, 16));
        * otherwise (Wan): the token grid of :attr:`default_size` (Wan2.1's 81x480x832) under the model's own
          size rules, as Diffusers' pipeline takes a size (frames rounded to ``4k+1``, latents floored by the
          patch, no position bound): ``geometry`` when given (``mhla convert`` passes a pipeline folder's, with
          its VAE), else ``geometry.from_configs(transformer_config)``, i.e. the transformer's patch size with
          Wan2.1's VAE factors (x4 in time, x8 in space), since a transformer does not record its VAE. Wan2.1
          and Wan2.2-A14B (patch 1x2x2): (21, 30, 52); Wan2.2-TI2V-5B's x16 VAE needs ``geometry`` (or an
          explicit ``target_grid``) to get (21, 15, 26).
        """
        if self.default_tokens is not None:
            return self.default_tokens
        if self.default_size is None:
            if transformer_config is None or transformer_config.get("sample_size") is None:
                raise ValueError(f"{self.label}'s default token grid needs the transformer config's `sample_size`")
            side = int(transformer_config["sample_size"])
            return tuple(side // patch for patch in self.patch_grid(transformer_config))
        if geometry is None:
            geometry = self.geometry.from_configs(transformer_config)
        return geometry.token_grid(*self.default_size, strict=False)

    def default_grid_origin(
        self, transformer_config: Mapping[str, Any] | None = None, geometry: VideoGeometry | None = None
    ) -> str:
        """Where :meth:`default_grid` (with the same arguments) comes from, in words, for logs and summaries."""
        config = transformer_config or {}
        if self.default_tokens is not None:
            return f"{self.label}'s default size {'x'.join(map(str, self.default_pixels))}"
        if self.default_size is None:
            return f"{self.label}'s sample_size {config.get('sample_size')} / patch {self.patch_grid(config)[0]}"
        if geometry is None:
            geometry = self.geometry.from_configs(config)
        return f"{self.label}'s default size {'x'.join(map(str, self.default_size))} with {geometry.describe()}"


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
        attention_sites=(("blocks", "attn1"),),
        fixed_grid=False,
        default_size=WAN_480P,
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
        attention_sites=(("transformer_blocks", "attn1"),),
        fixed_grid=True,
    ),
    "skyreels-v2": ModelFamily(
        name="skyreels-v2",
        label="SkyReels-V2",
        transformer_class_name="SkyReelsV2Transformer3DModel",
        legacy_class_names=(),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLASkyReelsV2Transformer3DModel",
        processor_path="mhla_diffusion.models.processors.skyreels:SkyReelsV2MHLAProcessor",
        pipeline_paths=(
            "diffusers:SkyReelsV2Pipeline",
            "diffusers:SkyReelsV2DiffusionForcingPipeline",
            "diffusers:SkyReelsV2ImageToVideoPipeline",
        ),
        tiny_path="mhla_diffusion.models.tiny_families:tiny_skyreels_v2_transformer",
        geometry=None,
        grid_axes=("frames", "height", "width"),
        attention_sites=(("blocks", "attn1"),),
        fixed_grid=False,
        default_tokens=(25, 34, 60),  # 97x544x960, VAE 4x8x8, patch 1x2x2
        default_pixels=(97, 544, 960),
        patch_keys=("patch_size",),
    ),
    "hunyuan-video": ModelFamily(
        name="hunyuan-video",
        label="HunyuanVideo",
        transformer_class_name="HunyuanVideoTransformer3DModel",
        legacy_class_names=(),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLAHunyuanVideoTransformer3DModel",
        processor_path="mhla_diffusion.models.processors.hunyuan_video:HunyuanVideoMHLAProcessor",
        pipeline_paths=("diffusers:HunyuanVideoPipeline", "diffusers:HunyuanVideoImageToVideoPipeline"),
        tiny_path="mhla_diffusion.models.tiny_families:tiny_hunyuan_video_transformer",
        geometry=None,
        grid_axes=("frames", "height", "width"),
        attention_sites=(("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")),
        fixed_grid=False,
        default_tokens=(33, 45, 80),  # 129x720x1280, VAE 4x8x8, patch 1x2x2
        default_pixels=(129, 720, 1280),
        patch_keys=("patch_size_t", "patch_size", "patch_size"),
        joint=True,
    ),
    "ltx-video": ModelFamily(
        name="ltx-video",
        label="LTX-Video",
        transformer_class_name="LTXVideoTransformer3DModel",
        legacy_class_names=(),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLALTXVideoTransformer3DModel",
        processor_path="mhla_diffusion.models.processors.ltx_video:LTXVideoMHLAProcessor",
        pipeline_paths=("diffusers:LTXPipeline", "diffusers:LTXImageToVideoPipeline"),
        tiny_path="mhla_diffusion.models.tiny_families:tiny_ltx_video_transformer",
        geometry=None,
        grid_axes=("frames", "height", "width"),
        attention_sites=(("transformer_blocks", "attn1"),),
        fixed_grid=False,
        default_tokens=(21, 16, 22),  # 161x512x704, VAE 8x32x32, patch 1x1x1
        default_pixels=(161, 512, 704),
        grid_source="size_arguments",
        patch_keys=("patch_size_t", "patch_size", "patch_size"),
    ),
    "cogvideox": ModelFamily(
        name="cogvideox",
        label="CogVideoX",
        transformer_class_name="CogVideoXTransformer3DModel",
        legacy_class_names=(),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLACogVideoXTransformer3DModel",
        processor_path="mhla_diffusion.models.processors.cogvideox:CogVideoXMHLAProcessor",
        pipeline_paths=("diffusers:CogVideoXPipeline", "diffusers:CogVideoXImageToVideoPipeline"),
        tiny_path="mhla_diffusion.models.tiny_families:tiny_cogvideox_transformer",
        geometry=None,
        grid_axes=("frames", "height", "width"),
        attention_sites=(("transformer_blocks", "attn1"),),
        fixed_grid=False,
        default_tokens=(13, 30, 45),  # 49x480x720, VAE 4x8x8, patch 1x2x2 (CogVideoX 1.0)
        default_pixels=(49, 480, 720),
        grid_source="frames_first",
        patch_keys=("patch_size_t", "patch_size", "patch_size"),
        joint=True,
    ),
    "sana-video": ModelFamily(
        name="sana-video",
        label="SANA-Video",
        transformer_class_name="SanaVideoTransformer3DModel",
        legacy_class_names=(),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLASanaVideoTransformer3DModel",
        processor_path="mhla_diffusion.models.processors.sana_video:SanaVideoMHLAProcessor",
        pipeline_paths=("diffusers:SanaVideoPipeline", "diffusers:SanaImageToVideoPipeline"),
        tiny_path="mhla_diffusion.models.tiny_families:tiny_sana_video_transformer",
        geometry=None,
        grid_axes=("frames", "height", "width"),
        attention_sites=(("transformer_blocks", "attn1"),),
        fixed_grid=False,
        default_tokens=(21, 30, 52),  # 81x480x832, VAE 4x8x8, patch 1x2x2
        default_pixels=(81, 480, 832),
        patch_keys=("patch_size",),
    ),
    "flux": ModelFamily(
        name="flux",
        label="Flux",
        transformer_class_name="FluxTransformer2DModel",
        legacy_class_names=(),
        mhla_transformer_path="mhla_diffusion.models.transformers:MHLAFluxTransformer2DModel",
        processor_path="mhla_diffusion.models.processors.flux:FluxMHLAProcessor",
        pipeline_paths=("diffusers:FluxPipeline", "diffusers:FluxImg2ImgPipeline"),
        tiny_path="mhla_diffusion.models.tiny_families:tiny_flux_transformer",
        geometry=None,
        grid_axes=("rows", "columns"),
        attention_sites=(("transformer_blocks", "attn"), ("single_transformer_blocks", "attn")),
        fixed_grid=False,
        default_tokens=(64, 64),  # 1024x1024, VAE x8, 2x2 packing
        default_pixels=(1024, 1024),
        grid_source="image_ids",
        joint=True,
    ),
}


def family_named(name: str) -> ModelFamily:
    """The family called ``name`` (``"wan"`` or ``"dit"``), or a ``ValueError`` naming the choices."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected one of {', '.join(map(repr, FAMILIES))}")
    return FAMILIES[name]


def family_of(transformer: Any) -> ModelFamily:
    """The family of a transformer instance (a Diffusers Wan or DiT transformer, or a subclass)."""
    for family in FAMILIES.values():
        if isinstance(transformer, family.transformer_class()):
            return family
    supported = ", ".join(f.transformer_class_name for f in FAMILIES.values())
    raise TypeError(f"MHLA supports Diffusers' {supported}, got {type(transformer).__name__}")


def family_for_class_name(class_name: str | None) -> ModelFamily | None:
    """The family whose transformer a ``config.json`` ``_class_name`` names (legacy names and the MHLA classes
    too), else ``None``."""
    return next((f for f in FAMILIES.values() if class_name in f.class_names), None)
