"""Transformer classes that carry MHLA in their own Diffusers config.

They are Diffusers' own Wan and DiT transformers with one more config entry, ``mhla``: the resolved
:class:`~mhla_diffusion.config.MHLAConfig` as a dict (``None``: softmax attention). ``__init__`` converts the
model when it is given, and :func:`~mhla_diffusion.models.conversion.convert_to_mhla` /
:func:`~mhla_diffusion.models.conversion.revert_mhla` keep it up to date, so ``save_pretrained`` writes one
standard Diffusers folder and ``from_pretrained`` (Diffusers' own, with its formats: safetensors or pickle,
variants, shards) rebuilds the MHLA processors and loads their parameters. Folders written before the entry
existed (a separate ``mhla_config.json`` beside the weights) still load. The DiT class also honours a
``timestep_freq_shift`` recorded in its ``config.json`` (see :func:`set_timestep_freq_shift`). A pipeline
folder saved by our pipelines names these classes in its ``model_index.json``, so even Diffusers' stock
``WanPipeline.from_pretrained`` / ``DiTPipeline`` reload MHLA intact instead of silently falling back to
softmax attention.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from diffusers import (
    CogVideoXTransformer3DModel,
    DiTTransformer2DModel,
    FluxTransformer2DModel,
    HunyuanVideoTransformer3DModel,
    LTXVideoTransformer3DModel,
    SanaVideoTransformer3DModel,
    SkyReelsV2Transformer3DModel,
    WanTransformer3DModel,
)
from diffusers.configuration_utils import register_to_config

from ..config import MHLAConfig
from ..loaders.plan import from_pretrained_keeping_mhla
from .conversion import MHLA_CONFIG_KEY, convert_to_mhla, sync_mhla_config
from .processors.base import FP32_PARAMETERS

__all__ = [
    "MHLACogVideoXTransformer3DModel",
    "MHLADiTTransformer2DModel",
    "MHLAFluxTransformer2DModel",
    "MHLAHunyuanVideoTransformer3DModel",
    "MHLALTXVideoTransformer3DModel",
    "MHLASanaVideoTransformer3DModel",
    "MHLASkyReelsV2Transformer3DModel",
    "MHLAWanTransformer3DModel",
    "apply_timestep_freq_shift",
    "set_timestep_freq_shift",
    "shift_applied_quietly",
]

#: The ``config.json`` key of :func:`set_timestep_freq_shift`.
TIMESTEP_FREQ_SHIFT = "timestep_freq_shift"


def set_timestep_freq_shift(transformer: DiTTransformer2DModel, shift: float) -> None:
    """Set the frequency shift of a DiT's timestep sinusoid in every block, and record it in its config.

    Diffusers' DiT embeds timestep ``t`` with frequencies ``10000 ** (-i / (128 - shift))``,
    ``i < 128``, and builds every block with ``shift = 1``; the original DiT (like ADM and GLIDE)
    uses ``10000 ** (-i / 128)``, i.e. ``shift = 0``. Weights imported from an original checkpoint
    reproduce the original model only with ``shift = 0``. The value goes into the transformer's
    config, so ``save_pretrained`` writes it to ``config.json``; :class:`MHLADiTTransformer2DModel`
    (and :func:`mhla_diffusion.loaders.weights.load_transformer`) apply it again on loading. Stock
    ``DiTTransformer2DModel.from_pretrained`` warns that it ignores the key and keeps ``shift = 1``.
    """
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = shift
    transformer.register_to_config(**{TIMESTEP_FREQ_SHIFT: shift})


class _DropShiftWarning(logging.Filter):
    """Drops Diffusers' warning that a config's ``timestep_freq_shift`` (and nothing else) "will be ignored"."""

    pattern = re.compile(rf"The config attributes \{{'{TIMESTEP_FREQ_SHIFT}': [^,{{}}]+\}} were passed to ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


@contextmanager
def shift_applied_quietly() -> Iterator[None]:
    """For our loaders, which apply ``timestep_freq_shift`` after Diffusers builds the model: silence Diffusers'
    warning that it ignores the key (stock ``from_pretrained`` elsewhere still warns, rightly)."""
    logger, quiet = logging.getLogger("diffusers.configuration_utils"), _DropShiftWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def apply_timestep_freq_shift(transformer: DiTTransformer2DModel) -> DiTTransformer2DModel:
    """Apply the ``timestep_freq_shift`` its config records (a no-op without one); returns ``transformer``."""
    shift = transformer.config.get(TIMESTEP_FREQ_SHIFT)
    if shift is not None:
        set_timestep_freq_shift(transformer, shift)
    return transformer


def _with_mhla_parameter(base_init: Callable[..., None]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give an ``__init__(self, *args, mhla=None, **kwargs)`` the signature of ``base_init`` plus ``mhla``: Diffusers
    reads a model's config keys, and the defaults it records, from its ``__init__`` signature."""
    base = inspect.signature(base_init)
    mhla = inspect.Parameter(
        MHLA_CONFIG_KEY, inspect.Parameter.KEYWORD_ONLY, default=None, annotation="MHLAConfig | dict | None"
    )

    def with_signature(init: Callable[..., None]) -> Callable[..., None]:
        init.__signature__ = base.replace(parameters=[*base.parameters.values(), mhla])
        return init

    return with_signature


def _init_mhla(model: Any, mhla: MHLAConfig | dict | None) -> None:
    """Convert a freshly built model with ``mhla`` (its ``__init__`` argument; ``None``: leave it softmax)."""
    if mhla is not None:
        convert_to_mhla(model, mhla if isinstance(mhla, MHLAConfig) else MHLAConfig.from_dict(mhla))


class _MHLAConfigLoading:
    """``from_pretrained`` / ``save_pretrained`` of the MHLA transformer classes.

    Mixed in before the Diffusers class.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> Any:
        """Diffusers' ``from_pretrained``, strict about MHLA parameters, also of folders with an ``mhla_config.json``
        (see :func:`~mhla_diffusion.loaders.plan.from_pretrained_keeping_mhla`)."""
        return from_pretrained_keeping_mhla(super().from_pretrained, pretrained_model_name_or_path, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Diffusers' ``save_pretrained``, with the ``mhla`` entry first brought up to date (processors set by hand)."""
        sync_mhla_config(self)
        super().save_pretrained(save_directory, **kwargs)

    def to_json_string(self) -> str:
        """The config as Diffusers writes it, with the stock class's name as ``_class_name``.

        Every MHLA transformer folder then reads alike, whichever class saved it (this one, or a converted
        ``WanTransformer3DModel``): our loaders rebuild MHLA from the ``mhla`` entry, and Diffusers'
        ``AutoModel.from_pretrained(folder)``, which looks ``_class_name`` up in the ``diffusers`` module only,
        loads the stock class with softmax attention and a warning naming our loader (instead of failing
        with "`diffusers` has no class MHLAWanTransformer3DModel"). A pipeline folder's ``model_index.json``
        still names this class, so ``AutoModel.from_pretrained(pipeline_folder, subfolder="transformer")``
        loads MHLA once ``import mhla_diffusion`` has run.
        """
        config = json.loads(super().to_json_string())
        config["_class_name"] = next(c for c in type(self).__mro__ if c.__module__.startswith("diffusers.")).__name__
        return json.dumps(config, indent=2, sort_keys=True) + "\n"


class MHLAWanTransformer3DModel(_MHLAConfigLoading, WanTransformer3DModel):
    """``WanTransformer3DModel`` whose config holds its MHLA setting (``mhla``, see the module docstring).

    ``MHLAWanTransformer3DModel(**wan_config, mhla=MHLAConfig(...))`` builds a converted model; ``from_pretrained``
    of a folder it (or a converted ``WanTransformer3DModel``) saved rebuilds it with its MHLA parameters.
    """

    _keep_in_fp32_modules = [*WanTransformer3DModel._keep_in_fp32_modules, *FP32_PARAMETERS]

    @register_to_config
    @_with_mhla_parameter(WanTransformer3DModel.__init__)
    def __init__(self, *args: Any, mhla: MHLAConfig | dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _init_mhla(self, mhla)


class MHLADiTTransformer2DModel(_MHLAConfigLoading, DiTTransformer2DModel):
    """``DiTTransformer2DModel`` whose config holds its MHLA setting (``mhla``, see the module docstring)."""

    _keep_in_fp32_modules = [*(DiTTransformer2DModel._keep_in_fp32_modules or ()), *FP32_PARAMETERS]

    @register_to_config
    @_with_mhla_parameter(DiTTransformer2DModel.__init__)
    def __init__(self, *args: Any, mhla: MHLAConfig | dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _init_mhla(self, mhla)

    @classmethod
    def from_config(cls, config: Any = None, return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        """Diffusers' ``from_config`` (which ``from_pretrained`` uses), plus a recorded ``timestep_freq_shift``."""
        with shift_applied_quietly():
            out = super().from_config(config, return_unused_kwargs=return_unused_kwargs, **kwargs)
        apply_timestep_freq_shift(out[0] if return_unused_kwargs else out)
        return out


def _mhla_class(base: type) -> type:
    """``base`` (a Diffusers transformer class) whose config holds its MHLA setting, as
    :class:`MHLAWanTransformer3DModel` is for Wan: named ``MHLA<base name>``, defined in this module."""

    @register_to_config
    @_with_mhla_parameter(base.__init__)
    def __init__(self: Any, *args: Any, mhla: MHLAConfig | dict | None = None, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        _init_mhla(self, mhla)

    name = f"MHLA{base.__name__}"
    namespace = {
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"``{base.__name__}`` whose config holds its MHLA setting (``mhla``, see the module docstring).",
        "_keep_in_fp32_modules": [*(getattr(base, "_keep_in_fp32_modules", None) or ()), *FP32_PARAMETERS],
    }
    return type(name, (_MHLAConfigLoading, base), namespace)


MHLASkyReelsV2Transformer3DModel = _mhla_class(SkyReelsV2Transformer3DModel)
MHLAHunyuanVideoTransformer3DModel = _mhla_class(HunyuanVideoTransformer3DModel)
MHLALTXVideoTransformer3DModel = _mhla_class(LTXVideoTransformer3DModel)
MHLACogVideoXTransformer3DModel = _mhla_class(CogVideoXTransformer3DModel)
MHLASanaVideoTransformer3DModel = _mhla_class(SanaVideoTransformer3DModel)
MHLAFluxTransformer2DModel = _mhla_class(FluxTransformer2DModel)
