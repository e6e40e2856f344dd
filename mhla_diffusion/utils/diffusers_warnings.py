"""Make Diffusers' own warnings say so when one of its loaders silently drops MHLA.

Two of Diffusers' stock loaders run softmax attention where the user meant MHLA, and only warn in
generic words that Diffusers offers no hook to change:

* ``AutoModel`` / ``WanTransformer3DModel`` / ``DiTTransformer2DModel.from_pretrained(<MHLA transformer folder>)``
  loads the model without its MHLA layers ("Some weights of the model checkpoint ... were not used ...",
  the unused keys being ``...processor...``);
* ``DiffusionPipeline`` / ``WanPipeline`` / ``DiTPipeline.from_pretrained(base, mhla_weights=...)`` ignores the
  keyword ("Keyword arguments {'mhla_weights': ...} are not expected by WanPipeline and will be ignored.").

A third drops the MHLA transformer: the stock ``WanPipeline`` / ``DiTPipeline.from_pipe(mhla_pipe)``. Diffusers'
``from_pipe`` keeps a model component only when its type is exactly one the new pipeline's ``__init__``
annotation lists (no subclass passes), so the MHLA transformer class our pipelines load from an MHLA folder
is left out ("component transformer is not switched over ..."): the new ``WanPipeline``'s first call
fails, ``DiTPipeline.from_pipe`` raises that its transformer is missing.

:func:`install` (run by ``import mhla_diffusion``; logging only, no torch) adds a :class:`logging.Filter` to
the two Diffusers loggers that writes what happened and the call to use at the end of those warnings.
"""

from __future__ import annotations

import logging

__all__ = ["MODEL_LOGGER", "PIPELINE_LOGGER", "install"]

MODEL_LOGGER = "diffusers.models.modeling_utils"
PIPELINE_LOGGER = "diffusers.pipelines.pipeline_utils"

_MODEL_HINT = (
    " -- these are MHLA layers (the folder's config.json has an `mhla` entry, or it has an "
    "mhla_config.json): the model was loaded with softmax "
    "attention instead. Load it with mhla_diffusion.load_mhla(folder) or "
    "MHLAWanTransformer3DModel / MHLADiTTransformer2DModel.from_pretrained(folder)"
)
_PIPELINE_HINT = (
    " -- mhla_weights / mhla_weights_2 are mhla_diffusion keywords: this pipeline runs softmax "
    "attention without them. Load MHLA weights with mhla_diffusion.MHLAWanPipeline / "
    "MHLAWanImageToVideoPipeline / MHLADiTPipeline.from_pretrained(base, mhla_weights=...)"
)

_FROM_PIPE_HINT = (
    " -- this is an MHLA transformer: Diffusers' from_pipe keeps a model only when its type is exactly one the "
    "new pipeline lists, so the stock WanPipeline / WanImageToVideoPipeline / DiTPipeline.from_pipe drops it: the new "
    "pipeline gets no transformer. Use mhla_diffusion's MHLAWanPipeline / MHLAWanImageToVideoPipeline / "
    "MHLADiTPipeline.from_pipe(pipe), or pass it: from_pipe(pipe, transformer=pipe.transformer)"
)


class _MHLAHint(logging.Filter):
    """Appends ``hint`` to a record whose message starts with ``start`` and contains ``marker``."""

    def __init__(self, start: str, marker: str, hint: str) -> None:
        super().__init__()
        self.start, self.marker, self.hint = start, marker, hint

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.start) and self.marker in message and self.hint not in message:
            record.msg, record.args = message + self.hint, ()
        return True


def install() -> None:
    """Add the hints to Diffusers' loggers (once per process)."""
    for name, hint in (
        (MODEL_LOGGER, _MHLAHint("Some weights of the model checkpoint", ".processor.", _MODEL_HINT)),
        (PIPELINE_LOGGER, _MHLAHint("Keyword arguments", "'mhla_weights", _PIPELINE_HINT)),
        (PIPELINE_LOGGER, _MHLAHint("component transformer", "mhla_diffusion.", _FROM_PIPE_HINT)),
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _MHLAHint) and f.hint == hint.hint for f in logger.filters):
            logger.addFilter(hint)
