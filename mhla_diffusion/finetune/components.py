"""Load single components (VAE, text encoder, tokenizer, scheduler, transformer) of a Diffusers
pipeline folder or hub id, so a trainer loads only what it needs (no text encoder with a full cache).

The transformer comes out converted to MHLA: restored from the folder when it was saved by our
pipelines (``transformer/mhla_config.json``), loaded from ``mhla_weights``, or freshly converted
with the run's :class:`MHLAConfig` (:func:`load_mhla_transformer`); or, for ``attention: softmax``
runs, as it is, which must then be a softmax model (:func:`load_softmax_transformer`).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import MHLAConfig
from ..loaders.weights import load_mhla, load_transformer, read_mhla_config
from ..models.conversion import convert_to_mhla
from .options import mhla_config_from_options  # torch-free: the options check it first

__all__ = [
    "load_component",
    "load_mhla_transformer",
    "load_softmax_transformer",
    "mhla_config_from_options",
    "pipeline_index",
    "save_plain_transformer",
]


def pipeline_index(source: str, revision: str | None = None) -> dict[str, Any]:
    """The ``model_index.json`` of a pipeline folder or hub repo."""
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.load_config(source, revision=revision)
    except (OSError, EnvironmentError) as err:
        raise FileNotFoundError(f"{source} is not a Diffusers pipeline (no model_index.json): {err}") from None


def load_component(source: str, name: str, revision: str | None = None, dtype: torch.dtype | None = None) -> Any:
    """Component ``name`` of the pipeline at ``source``, with the class its ``model_index.json`` names."""
    index = pipeline_index(source, revision)
    entry = index.get(name)
    if not entry or entry[0] is None:
        raise ValueError(f"the pipeline at {source} has no `{name}` component")
    library, class_name = entry
    cls = getattr(importlib.import_module(library), class_name)
    kwargs: dict[str, Any] = {"subfolder": name}
    if revision is not None:
        kwargs["revision"] = revision
    if dtype is not None and isinstance(cls, type) and issubclass(cls, nn.Module):
        kwargs["dtype"] = dtype
    return cls.from_pretrained(source, **kwargs)


def load_mhla_transformer(
    source: str,
    config: MHLAConfig,
    mhla_weights: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, str]:
    """The pipeline's transformer with MHLA, and how MHLA got there (``saved``, ``mhla_weights``, ``converted``)."""
    kwargs: dict[str, Any] = {}
    if revision is not None:
        kwargs["revision"] = revision
    if dtype is not None:
        kwargs["dtype"] = dtype
    subfolder = "transformer" if _is_pipeline(source, revision) else None
    saved = read_mhla_config(source, subfolder=subfolder, **({"revision": revision} if revision else {}))
    if saved is not None and saved.get("contents") == "transformer":
        if mhla_weights is not None:
            raise ValueError(f"{source} already holds an MHLA transformer: drop `mhla_weights`")
        return load_mhla(source, subfolder=subfolder, **kwargs), "saved"
    transformer = load_transformer(source, subfolder=subfolder, **kwargs)
    if mhla_weights is not None:
        load_mhla(mhla_weights, transformer)
        return transformer, "mhla_weights"
    convert_to_mhla(transformer, config)
    return transformer, "converted"


def load_softmax_transformer(source: str, revision: str | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The pipeline's transformer as it is, for ``attention: softmax``; an MHLA transformer is an error."""
    kwargs: dict[str, Any] = {}
    if revision is not None:
        kwargs["revision"] = revision
    subfolder = "transformer" if _is_pipeline(source, revision) else None
    saved = read_mhla_config(source, subfolder=subfolder, **kwargs)
    if saved is not None:
        where = f"{source}/{subfolder}" if subfolder else source
        raise ValueError(
            f"attention: softmax, but {where} holds an MHLA transformer (an MHLA setting in its config): "
            "start from a softmax "
            "pipeline (e.g. the base model or a softmax run's <output_dir>/pipeline), or use attention: mhla"
        )
    if dtype is not None:
        kwargs["dtype"] = dtype
    return load_transformer(source, subfolder=subfolder, **kwargs)


def save_plain_transformer(transformer: nn.Module, folder: str | os.PathLike) -> Path:
    """Diffusers' ``save_pretrained`` of a transformer without MHLA (``attention: softmax`` runs);
    MHLA files left in ``folder`` by an earlier save are removed, so it never reloads as MHLA."""
    from ..loaders.weights import MHLA_CONFIG_NAME, MHLA_WEIGHTS_NAME

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in (MHLA_CONFIG_NAME, MHLA_WEIGHTS_NAME):
        (folder / name).unlink(missing_ok=True)
    transformer.save_pretrained(folder, safe_serialization=True)
    return folder


def _is_pipeline(source: str, revision: str | None) -> bool:
    """Whether ``source`` is a pipeline (has ``model_index.json``) rather than a transformer folder."""
    if os.path.isdir(source):
        return Path(source, "model_index.json").is_file()
    try:
        pipeline_index(source, revision)
        return True
    except FileNotFoundError:
        return False
