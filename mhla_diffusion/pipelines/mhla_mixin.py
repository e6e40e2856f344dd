"""What our pipelines add to Diffusers' ``WanPipeline`` / ``DiTPipeline``: MHLA in, MHLA out.

* ``from_pretrained(..., mhla_weights=DIR)`` loads a base pipeline and its MHLA weights in one call.
* ``save_pretrained`` writes ``transformer/mhla_config.json`` and names the MHLA-preserving
  transformer class in ``model_index.json``, so the folder reloads with MHLA intact both with our
  pipelines and with Diffusers' stock ``WanPipeline`` / ``DiTPipeline`` / ``DiffusionPipeline``
  once the process has run ``import mhla_diffusion``. Diffusers (0.42) resolves a component's library
  only from ``sys.modules`` (it never imports a module a folder names, and reads no entry points), so
  without the import it stops with its own error, which ends "import mhla_diffusion before calling
  `from_pretrained`". ``model_index.json`` carries the same instruction under :data:`LOAD_HINT_KEY`
  (Diffusers ignores keys starting with ``_``).
* ``softmax_attention()`` runs the same loaded model with its original softmax self-attention.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..conversion import MHLAConversion, get_mhla_conversion, softmax_attention
from ..weights import load_mhla, write_mhla_config

__all__ = ["LOAD_HINT", "LOAD_HINT_KEY", "MHLAPipelineMixin"]

#: ``model_index.json`` key (ignored by Diffusers) that says how to load an MHLA folder with stock loaders.
LOAD_HINT_KEY = "_mhla_diffusion_load"
LOAD_HINT = ("the transformer is an mhla_diffusion class: run `import mhla_diffusion` before Diffusers' "
             "DiffusionPipeline / WanPipeline / DiTPipeline.from_pretrained, or load with "
             "mhla_diffusion.MHLAWanPipeline / MHLADiTPipeline.from_pretrained")


class MHLAPipelineMixin:
    """Mixed into a Diffusers pipeline class whose ``transformer`` may carry MHLA processors."""

    #: Diffusers pipeline this one extends, recorded in ``model_index.json`` for stock loaders.
    _stock_pipeline_name: str = ""
    #: Stock and MHLA-preserving transformer class names, for ``model_index.json``.
    _stock_transformer_name: str = ""
    _mhla_transformer_name: str = ""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, mhla_weights: str | os.PathLike | None = None, **kwargs: Any
    ):
        """Diffusers' ``from_pretrained`` (local folder or hub id), plus MHLA weights from ``mhla_weights``.

        A folder saved by our ``save_pretrained`` already holds MHLA and needs no ``mhla_weights``.
        """
        kwargs.setdefault("disable_mmap", True)  # exact CPU reloads (see mhla_diffusion.weights)
        pipe = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if mhla_weights is not None:
            load_mhla(mhla_weights, pipe.transformer)
        return pipe

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Diffusers' ``save_pretrained`` that keeps MHLA loadable (see the module docstring)."""
        super().save_pretrained(save_directory, **kwargs)
        folder = Path(save_directory)
        converted = get_mhla_conversion(self.transformer) is not None
        if converted:
            write_mhla_config(self.transformer, folder / "transformer", contents="transformer")
        index_path = folder / "model_index.json"
        index = json.loads(index_path.read_text())
        index["_class_name"] = self._stock_pipeline_name
        index["transformer"] = (
            ["mhla_diffusion", self._mhla_transformer_name] if converted else ["diffusers", self._stock_transformer_name]
        )
        if converted:
            index[LOAD_HINT_KEY] = LOAD_HINT
        else:
            index.pop(LOAD_HINT_KEY, None)
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    @property
    def mhla(self) -> MHLAConversion | None:
        """What MHLA changed in the transformer (``None`` for a softmax model)."""
        return get_mhla_conversion(self.transformer)

    @contextmanager
    def softmax_attention(self) -> Iterator[Any]:
        """Inside the block, generate with the original softmax self-attention of the same weights."""
        with softmax_attention(self.transformer):
            yield self
