"""Transformer classes that keep MHLA across ``save_pretrained`` / ``from_pretrained``.

They are Diffusers' own Wan and DiT transformers with one change: ``from_pretrained`` reads the
``mhla_config.json`` that :func:`save_mhla` and our pipelines write beside the weights and restores
the MHLA layers strictly. The DiT class also honours a ``timestep_freq_shift`` recorded in its
``config.json`` (see :func:`set_timestep_freq_shift`). A pipeline folder saved by our pipelines names these classes in its
``model_index.json``, so even Diffusers' stock ``WanPipeline.from_pretrained`` / ``DiTPipeline``
reload MHLA intact instead of silently falling back to softmax attention.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from typing import Any, Iterator

from diffusers import DiTTransformer2DModel, WanTransformer3DModel

from ..loaders.weight_files import from_pretrained_keeping_mhla

__all__ = [
    "MHLADiTTransformer2DModel",
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

    @classmethod
    def from_config(cls, config: Any = None, return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        """Diffusers' ``from_config`` (which ``from_pretrained`` uses), plus a recorded ``timestep_freq_shift``."""
        with shift_applied_quietly():
            out = super().from_config(config, return_unused_kwargs=return_unused_kwargs, **kwargs)
        apply_timestep_freq_shift(out[0] if return_unused_kwargs else out)
        return out
