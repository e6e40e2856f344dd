"""Geometry: pixels -> latents -> tokens, and the token grid against the MHLA block layout.

The one home of these rules; the CLI, the pipelines, the trainers, the web app and the benchmark
all ask this module. The factors come from the model's own configs:

* video (Wan): the VAE compresses time by ``scale_factor_temporal`` and space by
  ``scale_factor_spatial``; the transformer cuts latents into ``patch_size`` (t, h, w) patches. A
  clip therefore has ``k * temporal + 1`` frames and sides that are multiples of ``spatial * patch``.
  Wan2.1 and Wan2.2-A14B: VAE x4 / x8, patch 1x2x2 (a token is 16x16 px); Wan2.2-TI2V-5B's VAE
  (``z_dim`` 48, ``scale_factor_spatial`` 16: a 2x2 pixel patch before an x8 network): a token is 32x32 px.
  Wan's RoPE table holds ``rope_max_seq_len`` positions per axis: that bounds the largest size.
* image (DiT): the VAE compresses by ``2 ** (len(block_out_channels) - 1)``; patches are square.
* generation: Diffusers' ``WanPipeline.check_inputs`` also refuses heights and widths that are not
  multiples of :data:`WAN_PIPELINE_SIZE_MULTIPLE` (16), whatever the VAE and patch; sizes for
  generation are therefore judged with ``generation=True`` (training sizes are not).

Nothing here imports torch, so every check can run before a model is loaded.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

#: Diffusers' ``WanPipeline.check_inputs`` requires ``height % 16 == 0 and width % 16 == 0`` for every
#: model (a constant there, not read from the VAE or the transformer).
WAN_PIPELINE_SIZE_MULTIPLE = 16

#: Largest seed the CLI and the web demo accept (seeds are 0 .. MAX_SEED: 32 bits, plenty to type; torch
#: generators take them all). One rule for both, kept here with the other torch-free input rules.
MAX_SEED = 2**32 - 1

#: Wan2.1's published 480p clip (frames, height, width): the default video size of the generation and convert
#: commands, and the size a Wan model's ``auto`` block layout is chosen for when no ``target_grid`` is given
#: (:attr:`mhla_diffusion.models.families.ModelFamily.default_size`).
WAN_480P = (81, 480, 832)

__all__ = [
    "MAX_SEED",
    "ImageGeometry",
    "VideoGeometry",
    "WAN_480P",
    "WAN_PIPELINE_SIZE_MULTIPLE",
    "check_equal_blocks",
    "check_layout_fits",
    "image_token_grid",
    "read_component_config",
    "validate_grid_layout",
    "video_token_grid",
]


def read_component_config(folder: str | os.PathLike, component: str) -> dict[str, Any] | None:
    """``<folder>/<component>/config.json`` as a dict, or ``None`` when it is not there (e.g. a hub id)."""
    path = Path(folder, component, "config.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class VideoGeometry:
    """Size rules of a Wan video model. Defaults: Wan2.1 (VAE 4x8x8, patch 1x2x2, RoPE 1024 positions)."""

    vae_scale_temporal: int = 4
    vae_scale_spatial: int = 8
    patch_size: tuple[int, int, int] = (1, 2, 2)
    #: Positions per axis of the model's RoPE table (``rope_max_seq_len``); ``None``: unbounded.
    max_tokens_per_axis: int | None = 1024

    @classmethod
    def from_configs(
        cls, transformer: Mapping[str, Any] | None = None, vae: Mapping[str, Any] | None = None
    ) -> "VideoGeometry":
        """From a transformer config and a VAE config (dicts or Diffusers ``FrozenDict``).

        Missing keys keep Wan2.1's.
        """
        transformer, vae = transformer or {}, vae or {}
        default = cls()
        return cls(  # a missing or null entry keeps the default, as WanPipeline does
            vae_scale_temporal=int(vae.get("scale_factor_temporal") or default.vae_scale_temporal),
            vae_scale_spatial=int(vae.get("scale_factor_spatial") or default.vae_scale_spatial),
            patch_size=tuple(int(p) for p in transformer.get("patch_size") or default.patch_size),
            max_tokens_per_axis=transformer.get("rope_max_seq_len", default.max_tokens_per_axis),
        )

    @classmethod
    def of_vae(cls, vae: Mapping[str, Any] | None) -> "VideoGeometry":
        """The rules of a Wan VAE alone (what it can encode): its scale factors, patch 1x1x1, no position bound."""
        scales = cls.from_configs(None, vae)
        return cls(scales.vae_scale_temporal, scales.vae_scale_spatial, (1, 1, 1), None)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "VideoGeometry":
        """From a local pipeline folder's ``transformer/`` and ``vae/`` configs (Wan2.1's rules for a hub id)."""
        return cls.from_configs(read_component_config(folder, "transformer"), read_component_config(folder, "vae"))

    @classmethod
    def from_pipeline(cls, pipe: Any) -> "VideoGeometry":
        """From a loaded pipeline (its ``transformer``, or ``transformer_2`` when a Wan2.2-A14B pipeline has only
        that one, and its ``vae``)."""
        vae = getattr(pipe, "vae", None)
        transformer = pipe.transformer if getattr(pipe, "transformer", None) is not None else pipe.transformer_2
        return cls.from_configs(transformer.config, vae.config if vae is not None else None)

    # ------------------------------------------------------------------ rules

    @property
    def size_multiple(self) -> tuple[int, int]:
        """Height and width must be multiples of these (VAE scale x patch)."""
        return self.vae_scale_spatial * self.patch_size[1], self.vae_scale_spatial * self.patch_size[2]

    @property
    def generation_multiple(self) -> tuple[int, int]:
        """Height and width multiples a Diffusers ``WanPipeline`` accepts: :attr:`size_multiple` and
        :data:`WAN_PIPELINE_SIZE_MULTIPLE` together."""
        return tuple(math.lcm(m, WAN_PIPELINE_SIZE_MULTIPLE) for m in self.size_multiple)  # type: ignore[return-value]

    def describe(self) -> str:
        """The model's factors, for error messages."""
        return (
            f"VAE x{self.vae_scale_temporal} in time and x{self.vae_scale_spatial} in space, "
            f"patch {'x'.join(map(str, self.patch_size))}"
        )

    def valid_frames(self, num_frames: int) -> bool:
        """``k * temporal + 1`` frames whose latent frames divide by the temporal patch."""
        t = self.vae_scale_temporal
        return num_frames >= 1 and (num_frames - 1) % t == 0 and ((num_frames - 1) // t + 1) % self.patch_size[0] == 0

    def frame_rule(self, examples: bool = True) -> str:
        """The frame-count rule in words: ``4k+1 (1, 5, 9, 13, ...)``, or ``4k+1`` without ``examples``."""
        rule = f"{self.vae_scale_temporal}k+1"
        if self.patch_size[0] > 1:
            rule += f" with latent frames divisible by {self.patch_size[0]}"
        return f"{rule} ({', '.join(map(str, self.example_frames()))}, ...)" if examples else rule

    def example_frames(self, count: int = 4) -> list[int]:
        """The smallest ``count`` valid frame counts (``[1, 5, 9, 13]`` for Wan2.1)."""
        step = self.vae_scale_temporal * self.patch_size[0]
        return [n for n in range(1, (count + 1) * step + 2) if self.valid_frames(n)][:count]

    def round_frames(self, num_frames: int) -> int:
        """The frame count a Diffusers ``WanPipeline`` generates for ``num_frames`` (``ValueError`` below 1).

        Its rule, kept exactly: a count with ``num_frames % temporal != 1`` becomes
        ``num_frames // temporal * temporal + 1`` (Wan2.1: 7 -> 5, 8 -> 9; with ``temporal`` 1 every count gains one).
        """
        t = self.vae_scale_temporal
        if num_frames < 1:
            raise ValueError(f"{num_frames} frames: need at least 1 ({self.frame_rule()})")
        return num_frames if num_frames % t == 1 else num_frames // t * t + 1

    def _too_large(self, name: str, size: int, limit: int) -> ValueError:
        return ValueError(
            f"{name} {size} is larger than the model supports: at most {limit} (its position encoding "
            f"holds {self.max_tokens_per_axis} tokens per axis; {self.describe()})"
        )

    def check_frames(self, num_frames: int) -> None:
        """Raise ``ValueError`` naming the model's factors when ``num_frames`` cannot be encoded or is too long."""
        if not self.valid_frames(num_frames):
            raise ValueError(f"{num_frames} frames is not supported: use {self.frame_rule()} ({self.describe()})")
        largest = self.max_size()
        if largest is not None and num_frames > largest[0]:
            raise self._too_large("frames", num_frames, largest[0])

    def check_resolution(self, height: int, width: int, *, generation: bool = False) -> None:
        """Raise ``ValueError`` naming the model's factors when ``height`` x ``width`` is no whole number of
        patches of latents or too large; ``generation``: also Diffusers' ``WanPipeline`` rule (multiples of 16)."""
        multiples = self.generation_multiple if generation else self.size_multiple
        largest = self.max_size()
        for axis, (name, size, multiple) in enumerate(zip(("height", "width"), (height, width), multiples)):
            if size < multiple or size % multiple:
                why = self.describe()
                if multiple != self.size_multiple[axis]:
                    why += f"; Diffusers' WanPipeline needs multiples of {WAN_PIPELINE_SIZE_MULTIPLE}"
                raise ValueError(f"{name} {size} must be a positive multiple of {multiple} ({why})")
            if largest is not None and size > largest[axis + 1]:
                raise self._too_large(name, size, largest[axis + 1])

    def check_size(self, num_frames: int, height: int, width: int, *, generation: bool = False) -> None:
        """Raise ``ValueError`` naming the model's factors when a clip size cannot be generated or encoded
        (:meth:`check_frames` and :meth:`check_resolution`)."""
        self.check_frames(num_frames)
        self.check_resolution(height, width, generation=generation)

    def max_size(self) -> tuple[int, int, int] | None:
        """Largest (frames, height, width) the position encoding supports, or ``None`` if unbounded."""
        if self.max_tokens_per_axis is None:
            return None
        n = int(self.max_tokens_per_axis)
        pt, ph, pw = self.patch_size
        return (
            (n * pt - 1) * self.vae_scale_temporal + 1,
            n * ph * self.vae_scale_spatial,
            n * pw * self.vae_scale_spatial,
        )

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Latent (frames, height, width) of a clip (sizes as the VAE floors them)."""
        return (
            (num_frames - 1) // self.vae_scale_temporal + 1,
            height // self.vae_scale_spatial,
            width // self.vae_scale_spatial,
        )

    def token_grid(self, num_frames: int, height: int, width: int, *, strict: bool = True) -> tuple[int, int, int]:
        """Token grid (frames, height, width) the transformer sees for a clip.

        ``strict`` (default) first checks the size (:meth:`check_size`); ``strict=False`` takes any size as
        Diffusers' ``WanPipeline`` does (frames as :meth:`round_frames`, latent sizes floored).
        """
        if strict:
            self.check_size(num_frames, height, width)
        else:
            num_frames = self.round_frames(max(num_frames, 1))
        latent = self.latent_shape(num_frames, height, width)
        return tuple(size // patch for size, patch in zip(latent, self.patch_size))  # type: ignore[return-value]


@dataclass(frozen=True)
class ImageGeometry:
    """Size rules of a DiT image model. Defaults: DiT-XL/2 (VAE x8, patch 2)."""

    vae_scale: int = 8
    patch_size: int = 2

    @classmethod
    def from_configs(
        cls, transformer: Mapping[str, Any] | None = None, vae: Mapping[str, Any] | None = None
    ) -> "ImageGeometry":
        """From a transformer config and a VAE config (Diffusers' ``2 ** (len(block_out_channels) - 1)``)."""
        transformer, vae = transformer or {}, vae or {}
        scale = 2 ** (len(vae["block_out_channels"]) - 1) if "block_out_channels" in vae else cls.vae_scale
        return cls(vae_scale=int(scale), patch_size=int(transformer.get("patch_size", cls.patch_size)))

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "ImageGeometry":
        return cls.from_configs(read_component_config(folder, "transformer"), read_component_config(folder, "vae"))

    @property
    def size_multiple(self) -> int:
        return self.vae_scale * self.patch_size

    def describe(self) -> str:
        return f"VAE x{self.vae_scale}, patch {self.patch_size}"

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """Token grid (rows, columns) of an ``height`` x ``width`` image."""
        step = self.size_multiple
        for name, size in (("height", height), ("width", width)):
            if size < step or size % step:
                raise ValueError(f"{name} {size} must be a positive multiple of {step} ({self.describe()})")
        return height // step, width // step


def video_token_grid(
    num_frames: int,
    height: int,
    width: int,
    patch_size: Sequence[int] = VideoGeometry.patch_size,
    vae_scale: Sequence[int] = (
        VideoGeometry.vae_scale_temporal,
        VideoGeometry.vae_scale_spatial,
        VideoGeometry.vae_scale_spatial,
    ),
) -> tuple[int, int, int]:
    """Token grid (frames, height, width) of a Wan video of ``num_frames`` x ``height`` x ``width`` pixels."""
    if vae_scale[1] != vae_scale[2]:
        raise ValueError(f"`vae_scale` {tuple(vae_scale)} must scale height and width alike")
    geometry = VideoGeometry(int(vae_scale[0]), int(vae_scale[1]), tuple(int(p) for p in patch_size), None)
    return geometry.token_grid(num_frames, height, width)


def image_token_grid(
    height: int, width: int, patch_size: int = ImageGeometry.patch_size, vae_scale: int = ImageGeometry.vae_scale
) -> tuple[int, int]:
    """Token grid (rows, columns) of a DiT image of ``height`` x ``width`` pixels."""
    return ImageGeometry(int(vae_scale), int(patch_size)).token_grid(height, width)


# ---------------------------------------------------------------------- token grid vs block layout


def validate_grid_layout(
    grid: Sequence[int], layout: Sequence[int], num_tokens: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check ``grid`` and ``layout`` against each other (and ``num_tokens``); return them as tuples.

    A layout may have more blocks than the grid has tokens on an axis (an image's single frame under
    a video layout): tokens still go to block ``floor(c * L / G)``, and the blocks that receive no
    token are empty (they add nothing to any sum and hold no query). Raises ``ValueError`` naming
    the offending argument.
    """
    try:
        grid = tuple(int(g) for g in grid)
    except TypeError:
        raise ValueError(f"`grid` must be a sequence of 1 to 3 positive ints, got {grid!r}") from None
    try:
        layout = tuple(int(b) for b in layout)
    except TypeError:
        raise ValueError(f"`layout` must be a sequence of ints (blocks per axis), got {layout!r}") from None
    if not 1 <= len(grid) <= 3 or any(g < 1 for g in grid):
        raise ValueError(f"`grid` must have 1 to 3 positive sizes, got {grid}")
    if len(layout) != len(grid):
        raise ValueError(
            f"`layout` {layout} has {len(layout)} axes but `grid` {grid} has {len(grid)}: "
            "give one block count per grid axis"
        )
    bad = [a for a, b in enumerate(layout) if b < 1]
    if bad:
        raise ValueError(f"`layout` {layout} has fewer than 1 block on axis {bad}: each axis needs at least 1 block")
    if num_tokens is not None and math.prod(grid) != num_tokens:
        raise ValueError(
            f"`grid` {grid} has {math.prod(grid)} tokens but the inputs have N={num_tokens}: "
            "the grid's product must equal N"
        )
    return grid, layout


def check_layout_fits(
    grid: Sequence[int], layout: Sequence[int], what: str, normalization: str = "denominator"
) -> None:
    """Raise ``ValueError`` when ``what`` (e.g. "a 9x32x32 video") has a token grid the MHLA block layout
    cannot run on: a different number of axes, or, with ``normalization="scalar_mixed_denominator"``,
    a grid the layout does not cut into equal blocks.

    A grid smaller than the layout on some axis is fine (the extra blocks are empty).
    """
    try:
        grid, layout = validate_grid_layout(grid, layout)
    except ValueError as error:
        raise ValueError(
            f"{what} has token grid {tuple(grid)}, which the MHLA block layout {tuple(layout)} cannot cut: {error}"
        ) from None
    if normalization == "scalar_mixed_denominator":
        check_equal_blocks(grid, layout, f"the token grid of {what}")


def _nearest_divisor(size: int, wanted: int) -> int:
    """The divisor of ``size`` closest to ``wanted`` (the smaller one on a tie)."""
    return min((d for d in range(1, size + 1) if size % d == 0), key=lambda d: (abs(d - wanted), d))


def check_equal_blocks(grid: Sequence[int], layout: Sequence[int], what: str = "the token grid") -> None:
    """Raise ``ValueError`` unless ``layout`` cuts ``grid`` into equal blocks (every axis divisible).

    The released DiT-MHLA denominator (``normalization="scalar_mixed_denominator"``) pairs the token
    at within-block position ``w`` of one block with the token at the same position ``w`` of every
    other block, so every block must hold the same tokens in the same arrangement. ``what`` names the
    grid in the message (e.g. "this forward's token grid (latent size // patch size)").
    """
    grid, layout = validate_grid_layout(grid, layout)
    bad = [a for a, (g, b) in enumerate(zip(grid, layout)) if g % b]
    if not bad:
        return
    even_layout = tuple(_nearest_divisor(g, b) for g, b in zip(grid, layout))
    even_grid = tuple(-(-g // b) * b for g, b in zip(grid, layout))
    raise ValueError(
        f"normalization 'scalar_mixed_denominator' (the released DiT-MHLA denominator) needs equal-size blocks, "
        f"but the block layout {layout} does not divide {what} {grid} (axis {bad}): use a layout whose entries "
        f"divide the grid, e.g. {even_layout}, or a grid that is a multiple of the layout, e.g. {even_grid}, "
        f"or normalization 'denominator', which accepts uneven blocks"
    )
