"""A pytest plugin that runs Diffusers' own model tests on the MHLA transformer classes.

Diffusers' model tests (``tests/models/transformers/test_models_transformer_*.py`` of a Diffusers checkout) build
their model as ``config.model_class(**config.get_init_dict())``. This plugin points every tester config whose
``model_class`` is a family MHLA supports at that family's MHLA class, and adds ``mhla=MHLAConfig().to_dict()`` to
its init dict, so every test (save / load, determinism, output shapes, training, memory, compile...) runs on a
converted model. Used by ``run.sh``; it is not part of this project's own suite (it needs a Diffusers checkout).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mhla_diffusion import MHLAConfig
from mhla_diffusion.models.families import family_for_class_name

#: Set by the environment of ``run.sh``: the MHLA setting the tests convert with (default ``MHLAConfig()``).
MHLA_SETTING = MHLAConfig().to_dict()


def _mhla_config_class(config_class: type) -> None:
    """Make the tester config ``config_class`` build its family's MHLA class, converted."""
    if config_class.__dict__.get("_mhla_patched"):
        return
    stock = config_class.model_class
    stock = stock.fget(None) if isinstance(stock, property) else stock
    family = family_for_class_name(getattr(stock, "__name__", None))
    if family is None or stock.__name__ != family.transformer_class_name:
        return
    mhla_class = family.mhla_transformer_class()
    original = config_class.get_init_dict

    def get_init_dict(self: Any) -> dict[str, Any]:
        return {**original(self), "mhla": dict(MHLA_SETTING)}

    config_class.model_class = property(lambda self: mhla_class)
    config_class.get_init_dict = get_init_dict
    if os.environ.get("MHLA_IMAGE_IDS") == "1" and hasattr(config_class, "get_dummy_inputs"):
        config_class.get_dummy_inputs = _with_image_ids(config_class.get_dummy_inputs)
    config_class._mhla_patched = True


def _with_image_ids(get_dummy_inputs: Any) -> Any:
    """``get_dummy_inputs`` whose Flux ``img_ids`` / ``txt_ids`` are the ones ``FluxPipeline`` makes (``(0, row,
    column)`` of one image, text ids 0) instead of random numbers, which give no token grid (``MHLA_IMAGE_IDS=1``)."""

    def inputs(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = get_dummy_inputs(self, *args, **kwargs)
        if "img_ids" not in out:
            return out
        ids = out["img_ids"]
        n = ids.shape[-2]
        rows = int(n**0.5)
        while n % rows:
            rows -= 1
        grid = torch.zeros(rows, n // rows, 3, dtype=ids.dtype, device=ids.device)
        grid[..., 1] += torch.arange(rows, device=ids.device)[:, None].to(ids.dtype)
        grid[..., 2] += torch.arange(n // rows, device=ids.device)[None, :].to(ids.dtype)
        out["img_ids"] = grid.reshape(-1, 3).expand(ids.shape).clone()
        out["txt_ids"] = torch.zeros_like(out["txt_ids"])
        return out

    return inputs


def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None:
            continue
        for klass in cls.__mro__:
            if "model_class" in klass.__dict__ and "get_init_dict" in klass.__dict__:
                _mhla_config_class(klass)
                break
