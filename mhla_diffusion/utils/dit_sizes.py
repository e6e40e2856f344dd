"""DiT model sizes, and each as a Diffusers ``DiTTransformer2DModel`` config.

The DiT paper's ``DiT_models`` table, in one place for the importer of original checkpoints
(:mod:`mhla_diffusion.loaders.original_dit`) and the from-scratch trainer (``model_size``): ``DiT-S/2`` ...
``DiT-XL/8``, ``DiT-L/2-half``, ``DiT-L/2-half-small-head``. No torch import.

=========================  =====  ======  =====  ============
name                       depth  hidden  heads  patch
=========================  =====  ======  =====  ============
DiT-S/2, /4, /8            12     384     6      2 / 4 / 8
DiT-B/2, /4, /8            12     768     12     2 / 4 / 8
DiT-L/2, /4, /8            24     1024    16     2 / 4 / 8
DiT-XL/2, /4, /8           28     1152    16     2 / 4 / 8
=========================  =====  ======  =====  ============

Every size is built as DiT builds it: adaLN-Zero blocks, GELU-tanh MLP of ratio 4, q/k/v with bias,
LayerNorms without affine and eps 1e-6, learned sigma (``out_channels = 2 * in_channels``), and a
class table of ``num_classes`` (+ the null class for guidance).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["DIT_MODEL_SIZES", "DiTModelSize", "dit_model_size", "dit_transformer_config"]


@dataclass(frozen=True)
class DiTModelSize:
    """One entry of the original ``DiT_models`` table (heads are not in the checkpoint's shapes)."""

    depth: int
    hidden_size: int
    num_heads: int
    patch_size: int


def _sizes() -> dict[str, DiTModelSize]:
    sizes = {}
    for name, depth, hidden, heads in (
        ("S", 12, 384, 6),
        ("B", 12, 768, 12),
        ("L", 24, 1024, 16),
        ("XL", 28, 1152, 16),
    ):
        for patch in (2, 4, 8):
            sizes[f"DiT-{name}/{patch}"] = DiTModelSize(depth, hidden, heads, patch)
    sizes["DiT-L/2-half"] = DiTModelSize(12, 1024, 16, 2)
    sizes["DiT-L/2-half-small-head"] = DiTModelSize(12, 1024, 8, 2)
    return sizes


#: The original DiT sizes by name (``DiT-XL/2`` ...), as in the released code's ``DiT_models``.
DIT_MODEL_SIZES: dict[str, DiTModelSize] = _sizes()


def dit_model_size(name: str) -> DiTModelSize:
    """The :class:`DiTModelSize` of ``name``: ``DiT-XL/2``, also spelled ``DiT-XL-2`` or ``XL/2`` (any case)."""
    key = name.strip().lower()
    key = key[4:] if key.startswith("dit-") else key
    key = re.sub(r"^(s|b|l|xl)[-_/](\d)", r"\1/\2", key)
    for known, size in DIT_MODEL_SIZES.items():
        if known.lower() == "dit-" + key:
            return size
    raise ValueError(f"unknown DiT model size {name!r}: choose one of {', '.join(DIT_MODEL_SIZES)}")


def dit_transformer_config(
    name: str,
    sample_size: int,
    in_channels: int = 4,
    num_classes: int = 1000,
    learn_sigma: bool = True,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``DiTTransformer2DModel`` config of size ``name`` on a ``sample_size`` square latent.

    ``overrides`` replaces any config entry (Diffusers' names: ``num_layers``, ``num_attention_heads``,
    ``attention_head_dim``, ``patch_size``, ...), e.g. a tiny width for tests.
    """
    size = dit_model_size(name)
    config: dict[str, Any] = dict(
        num_attention_heads=size.num_heads,
        attention_head_dim=size.hidden_size // size.num_heads,
        in_channels=in_channels,
        out_channels=2 * in_channels if learn_sigma else in_channels,
        num_layers=size.depth,
        sample_size=sample_size,
        patch_size=size.patch_size,
        num_embeds_ada_norm=num_classes,
        norm_type="ada_norm_zero",
        norm_elementwise_affine=False,
        norm_eps=1e-6,  # DiT's LayerNorms (Diffusers' default is 1e-5)
        activation_fn="gelu-approximate",
        attention_bias=True,
        dropout=0.0,
    )
    config.update(overrides or {})
    return config
