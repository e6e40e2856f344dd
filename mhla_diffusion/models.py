"""Transformer classes that keep MHLA across ``save_pretrained`` / ``from_pretrained``.

They are Diffusers' own Wan and DiT transformers with one change: ``from_pretrained`` reads the
``mhla_config.json`` that :func:`save_mhla` and our pipelines write beside the weights and restores
the MHLA layers strictly. A pipeline folder saved by our pipelines names these classes in its
``model_index.json``, so even Diffusers' stock ``WanPipeline.from_pretrained`` / ``DiTPipeline``
reload MHLA intact instead of silently falling back to softmax attention.
"""

from __future__ import annotations

import os
from typing import Any

from diffusers import DiTTransformer2DModel, WanTransformer3DModel

from .weight_files import from_pretrained_keeping_mhla

__all__ = ["MHLADiTTransformer2DModel", "MHLAWanTransformer3DModel", "mhla_transformer_class"]


class MHLAWanTransformer3DModel(WanTransformer3DModel):
    """``WanTransformer3DModel`` whose ``from_pretrained`` also restores saved MHLA layers."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> "MHLAWanTransformer3DModel":
        return from_pretrained_keeping_mhla(cls, super().from_pretrained, pretrained_model_name_or_path, **kwargs)


class MHLADiTTransformer2DModel(DiTTransformer2DModel):
    """``DiTTransformer2DModel`` whose ``from_pretrained`` also restores saved MHLA layers."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> "MHLADiTTransformer2DModel":
        return from_pretrained_keeping_mhla(cls, super().from_pretrained, pretrained_model_name_or_path, **kwargs)


def mhla_transformer_class(family: str) -> type:
    """The MHLA-preserving transformer class of a model family (``"wan"`` or ``"dit"``)."""
    classes = {"wan": MHLAWanTransformer3DModel, "dit": MHLADiTTransformer2DModel}
    if family not in classes:
        raise ValueError(f"unknown model family {family!r}: expected 'wan' or 'dit'")
    return classes[family]
