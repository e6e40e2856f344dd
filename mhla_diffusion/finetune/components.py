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
from ..loaders.plan import LoadPlan, resolve_source
from ..loaders.weights import load_mhla, load_transformer
from ..models.conversion import convert_to_mhla
from .options import mhla_config_from_options  # torch-free: the options check it first

__all__ = [
    "load_component",
    "load_mhla_transformer",
    "load_softmax_transformer",
    "mhla_config_from_options",
    "model_plan",
    "pipeline_index",
    "save_plain_transformer",
]


def model_plan(source: str | LoadPlan, revision: str | None = None) -> LoadPlan:
    """The :class:`~mhla_diffusion.loaders.plan.LoadPlan` of ``pretrained_model`` (a plan is returned as it is):
    a trainer resolves it once and hands it to the loaders below."""
    return resolve_source(source, **({"revision": revision} if revision else {}))


def pipeline_index(source: str | LoadPlan, revision: str | None = None) -> dict[str, Any]:
    """The ``model_index.json`` of a pipeline folder or hub repo."""
    plan = model_plan(source, revision)
    if plan.form != "pipeline" or plan.index is None:
        raise FileNotFoundError(
            f"{plan.where} is not a Diffusers pipeline (no model_index.json): it is {plan.describe()}"
        )
    return dict(plan.index)


def load_component(
    source: str | LoadPlan, name: str, revision: str | None = None, dtype: torch.dtype | None = None
) -> Any:
    """Component ``name`` of the pipeline at ``source``, with the class its ``model_index.json`` names."""
    plan = model_plan(source, revision)
    entry = pipeline_index(plan).get(name)
    if not entry or entry[0] is None:
        raise ValueError(f"the pipeline at {plan.where} has no `{name}` component")
    library, class_name = entry
    cls = getattr(importlib.import_module(library), class_name)
    kwargs: dict[str, Any] = {"subfolder": name, **plan.hub_kwargs}
    if dtype is not None and isinstance(cls, type) and issubclass(cls, nn.Module):
        kwargs["dtype"] = dtype
    return cls.from_pretrained(plan.source, **kwargs)


def _transformer_plan(plan: LoadPlan) -> LoadPlan:
    """The plan of the transformer a trainer loads: the pipeline's ``transformer``, or the transformer folder."""
    return plan.subplan("transformer") if plan.form == "pipeline" else plan


def load_mhla_transformer(
    source: str | LoadPlan,
    config: MHLAConfig,
    mhla_weights: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, str]:
    """The pipeline's transformer with MHLA, and how MHLA got there (``saved``, ``mhla_weights``, ``converted``)."""
    plan = _transformer_plan(model_plan(source, revision))
    kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
    if plan.form == "transformer" and plan.mhla is not None:
        if mhla_weights is not None:
            raise ValueError(f"{plan.where} already holds an MHLA transformer: drop `mhla_weights`")
        return load_mhla(plan, **kwargs), "saved"
    transformer = load_transformer(plan, **kwargs)
    if mhla_weights is not None:
        load_mhla(mhla_weights, transformer)
        return transformer, "mhla_weights"
    convert_to_mhla(transformer, config)
    return transformer, "converted"


def load_softmax_transformer(
    source: str | LoadPlan, revision: str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The pipeline's transformer as it is, for ``attention: softmax``; an MHLA transformer is an error."""
    plan = _transformer_plan(model_plan(source, revision))
    if plan.mhla is not None:
        raise ValueError(
            f"attention: softmax, but {plan.where} holds an MHLA transformer (an MHLA setting in its config): "
            "start from a softmax "
            "pipeline (e.g. the base model or a softmax run's <output_dir>/pipeline), or use attention: mhla"
        )
    return load_transformer(plan, **({"dtype": dtype} if dtype is not None else {}))


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
