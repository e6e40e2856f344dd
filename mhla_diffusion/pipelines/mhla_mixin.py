"""What our pipelines add to Diffusers' ``WanPipeline`` / ``DiTPipeline``: MHLA in, MHLA out.

* ``load_mhla_weights(DIR)`` (Diffusers' loader-method style, as ``load_lora_weights``) converts the
  pipeline's transformers and loads MHLA weights into them; ``from_pretrained(..., mhla_weights=DIR)`` loads a
  base pipeline and calls it. A pipeline with two transformers (Wan2.2-A14B: ``transformer`` for the
  high-noise steps, ``transformer_2`` for the rest) takes a folder with ``transformer/`` and ``transformer_2/``
  MHLA folders (what ``mhla convert`` and :meth:`save_mhla` write for it), or ``mhla_weights`` and
  ``mhla_weights_2``, one ``save_mhla`` folder each.
* ``convert_to_mhla(config, config_2=None)`` converts every transformer of the pipeline.
* ``save_pretrained`` writes each converted transformer's MHLA setting into its ``config.json`` (the ``mhla``
  entry) and names the MHLA-preserving transformer class in ``model_index.json``, so the folder reloads
  with MHLA intact both with our pipelines and with Diffusers' stock ``WanPipeline`` /
  ``WanImageToVideoPipeline`` / ``DiTPipeline`` / ``DiffusionPipeline``
  once the process has run ``import mhla_diffusion``. Diffusers (0.42) resolves a component's library
  only from ``sys.modules`` (it never imports a module a folder names, and reads no entry points), so
  without the import it stops with its own error, which ends "import mhla_diffusion before calling
  `from_pretrained`". ``model_index.json`` carries the same instruction under :data:`LOAD_HINT_KEY`
  (Diffusers ignores keys starting with ``_``).
* ``softmax_attention()`` runs the same loaded model (every transformer) with its original softmax
  self-attention; ``mhla`` / ``mhla_conversions`` say what MHLA changed.
* ``record_generation_defaults(height=..., guidance_scale=...)`` records what the pipeline generates by
  default (the trainers record the settings they trained with); ``save_pretrained`` writes it into
  ``model_index.json`` (:data:`~mhla_diffusion.utils.model_defaults.RECORD_KEY`), where the command line and the
  web demo read it, and ``from_pretrained`` reads it back, so a load and save keeps it.
* ``from_pretrained`` gives a transformer whose config records block-causal softmax attention
  (:data:`~mhla_diffusion.models.kv_cache.BLOCK_CAUSAL_KEY`, a ``softmax_block_causal`` training run's) its
  block-causal KV-cache processors back, so it generates as it was trained, in one pass or streamed.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from torch import nn

from ..config import MHLAConfig
from ..loaders.plan import TRANSFORMER_COMPONENTS, LoadPlan, mhla_weight_plans, plan_pipeline, plans_in_use
from ..loaders.weight_files import HUB_KWARGS, hub_kwargs_of, load_into, read_mhla_tensors
from ..loaders.weights import MHLA_CONFIG_NAME, save_mhla
from ..models.conversion import (
    MHLAConversion,
    get_mhla_conversion,
    resolve_mhla_config,
    softmax_attention,
    sync_mhla_config,
)
from ..models.conversion import convert_to_mhla as convert_transformer  # the pipeline's own method is convert_to_mhla
from ..models.kv_cache import restore_block_causal
from ..utils.model_defaults import RECORD_KEY, checked_record

__all__ = ["LOAD_HINT", "LOAD_HINT_KEY", "MHLAPipelineMixin", "TRANSFORMER_COMPONENTS"]

#: ``model_index.json`` key (ignored by Diffusers) that says how to load an MHLA folder with stock loaders.
LOAD_HINT_KEY = "_mhla_diffusion_load"
LOAD_HINT = (
    "the transformer is an mhla_diffusion class: run `import mhla_diffusion` before Diffusers' "
    "DiffusionPipeline / WanPipeline / WanImageToVideoPipeline / DiTPipeline.from_pretrained, or load with "
    "mhla_diffusion.MHLAWanPipeline / MHLAWanImageToVideoPipeline / MHLADiTPipeline.from_pretrained"
)


class MHLAPipelineMixin:
    """Mixed into a Diffusers pipeline class whose transformers (``transformer``, and ``transformer_2`` in
    two-transformer pipelines) may carry MHLA processors."""

    #: Diffusers pipeline this one extends, recorded in ``model_index.json`` for stock loaders.
    _stock_pipeline_name: str = ""
    #: Stock and MHLA-preserving transformer class names, for ``model_index.json``.
    _stock_transformer_name: str = ""
    _mhla_transformer_name: str = ""
    #: Which generation defaults the pipeline records (Wan: video sizes and text length; DiT: steps and guidance).
    _generates_video: bool = True

    @classmethod
    def _get_signature_types(cls) -> dict[str, tuple]:
        """Diffusers' expected types of the ``__init__`` arguments, with this pipeline's MHLA-preserving transformer
        class beside the stock one: ``from_pipe`` keeps a component only when its type is listed (exactly), so
        without it the MHLA transformer of a reloaded folder would be dropped."""
        from ..models import transformers

        types = super()._get_signature_types()
        mhla_class = getattr(transformers, cls._mhla_transformer_name)
        for name in TRANSFORMER_COMPONENTS:
            if name in types:
                types[name] = tuple(types[name]) + (mhla_class,)
        return types

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        mhla_weights: str | os.PathLike | None = None,
        mhla_weights_2: str | os.PathLike | None = None,
        **kwargs: Any,
    ):
        """Diffusers' ``from_pretrained`` (local folder or hub id), plus MHLA weights: a thin alias of
        :meth:`load_mhla_weights` on the loaded pipeline, whose arguments ``mhla_weights`` / ``mhla_weights_2`` are.

        Which weights go where is checked before the pipeline loads (from its ``model_index.json``) and is a
        ``ValueError`` / ``FileNotFoundError`` naming the fix. A folder saved by our ``save_pretrained`` already
        holds MHLA and needs no ``mhla_weights``.
        """
        plan = kwargs.pop("load_plan", None)
        if plan is None:
            plan = plan_pipeline(
                pretrained_model_name_or_path, mhla_weights, mhla_weights_2, overrides=kwargs, **hub_kwargs_of(kwargs)
            )
        elif mhla_weights is not None or mhla_weights_2 is not None:
            raise ValueError("from_pretrained: give the MHLA weights in `load_plan`, not beside it")
        with plans_in_use(plan.model):  # Diffusers' per-component loads take the plan's transformer plans
            pipe = super().from_pretrained(plan.model.source, **kwargs)
        pipe._load_mhla_plans(plan.mhla_weights)
        for name in TRANSFORMER_COMPONENTS:  # a block-causal softmax transformer (its config says so) runs as trained
            if getattr(pipe, name, None) is not None:
                restore_block_causal(getattr(pipe, name))
        recorded = (plan.model.index or {}).get(RECORD_KEY)
        if recorded is None:  # a published or embedded model: its known size goes with every folder saved from it
            recorded = _known_video_size(pretrained_model_name_or_path) if pipe._generates_video else None
        if recorded:  # Diffusers drops private model_index.json keys on loading
            pipe.record_generation_defaults(**recorded)
        return pipe

    def record_generation_defaults(self, **settings: Any) -> None:
        """Record what this pipeline generates by default, for ``save_pretrained`` to write into ``model_index.json``
        (see :mod:`mhla_diffusion.utils.model_defaults`): Wan pipelines any of ``num_frames``, ``height``,
        ``width``, ``num_inference_steps``, ``guidance_scale``, ``fps``, ``max_sequence_length``; DiT
        ``num_inference_steps`` and ``guidance_scale``. Merged into what is recorded already; checked here."""
        record = {**(self.config.get(RECORD_KEY) or {}), **settings}
        self.register_to_config(**{RECORD_KEY: checked_record(record, self._generates_video, type(self).__name__)})

    def load_mhla_weights(
        self,
        mhla_weights: str | os.PathLike | None,
        mhla_weights_2: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> dict[str, MHLAConversion]:
        """Convert this pipeline's transformers to MHLA with the weights of an MHLA-only folder, in place (as
        Diffusers' ``load_lora_weights`` loads an adapter onto a base pipeline).

        Args:
            mhla_weights: a local folder or hub repo written by ``save_mhla`` / ``mhla convert --output`` (or a whole
                converted transformer folder, of which only the MHLA parameters are read): its MHLA layers go into
                ``transformer``. For a two-transformer pipeline (Wan2.2-A14B) it may instead hold ``transformer/``
                and ``transformer_2/`` MHLA folders (what ``mhla convert`` and :meth:`save_mhla` write for such a
                pipeline), each loaded into the transformer of its name.
            mhla_weights_2: a ``save_mhla`` folder for ``transformer_2`` (e.g. each expert fine-tuned on its own).
            kwargs: hub options (``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download``).

        In a two-transformer pipeline MHLA weights must reach both transformers. Every folder is checked (from its
        small config files) before any transformer changes. Returns :attr:`mhla_conversions`.
        """
        unknown = sorted(set(kwargs) - set(HUB_KWARGS))
        if unknown:
            raise TypeError(
                f"load_mhla_weights() got unexpected keyword arguments {unknown}; it takes the hub options "
                f"{', '.join(HUB_KWARGS)}"
            )
        if mhla_weights is None and mhla_weights_2 is None:
            raise ValueError(
                "load_mhla_weights needs `mhla_weights` (or `mhla_weights_2`): a folder written by save_mhla"
            )
        self._load_mhla_plans(
            mhla_weight_plans(mhla_weights, mhla_weights_2, tuple(self.transformer_components), **kwargs)
        )
        return self.mhla_conversions

    def _load_mhla_plans(self, plans: Mapping[str, LoadPlan]) -> None:
        """Convert each transformer named in ``plans`` and load the MHLA weights its plan names (every transformer
        checked unconverted before any changes)."""
        converted = [name for name in plans if self.mhla_conversions[name] is not None]
        if converted:
            raise ValueError(
                f"{' and '.join(converted)} is already converted to MHLA: revert_mhla() it first, or load "
                "the weights into a base pipeline"
            )
        for name, plan in plans.items():
            assert plan.mhla is not None
            load_into(getattr(self, name), dict(plan.mhla), read_mhla_tensors(plan.mhla_weight_files()))

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Diffusers' ``save_pretrained`` that keeps MHLA loadable (see the module docstring): every transformer's
        ``config.json`` says what runs in it, and a converted one is named by its MHLA-preserving class in
        ``model_index.json``."""
        conversions = self.mhla_conversions
        for transformer in self.transformer_components.values():
            sync_mhla_config(transformer)  # processors set by hand since the conversion
        super().save_pretrained(save_directory, **kwargs)
        index_path = Path(save_directory) / "model_index.json"
        index = json.loads(index_path.read_text())
        index["_class_name"] = self._stock_pipeline_name
        for name, conversion in conversions.items():
            index[name] = (
                ["mhla_diffusion", self._mhla_transformer_name]
                if conversion is not None
                else ["diffusers", self._stock_transformer_name]
            )
        if any(conversion is not None for conversion in conversions.values()):
            index[LOAD_HINT_KEY] = LOAD_HINT
        else:
            index.pop(LOAD_HINT_KEY, None)
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def save_mhla(
        self, save_directory: str | os.PathLike, *, include_base: bool = False, overwrite: bool = False
    ) -> Path:
        """Save only what MHLA adds (or, with ``include_base``, the whole converted transformers), in the form
        ``from_pretrained(base, mhla_weights=save_directory)`` reads: the folder itself for a one-transformer
        pipeline, ``transformer/`` and ``transformer_2/`` in it for a two-transformer one (each a
        :func:`~mhla_diffusion.save_mhla` folder). Every transformer must have MHLA layers. Returns the folder."""
        transformers = self.transformer_components
        softmax = [name for name, conversion in self.mhla_conversions.items() if conversion is None]
        if softmax:
            raise ValueError(
                f"{' and '.join(softmax)} has no MHLA layers: convert it first (pipe.convert_to_mhla(config))"
            )
        folder = Path(save_directory)
        if len(transformers) == 1:
            return save_mhla(next(iter(transformers.values())), folder, include_base=include_base, overwrite=overwrite)
        taken = [str(folder / name) for name in transformers if (folder / name / MHLA_CONFIG_NAME).exists()]
        if taken and not overwrite:  # checked for both before either is written
            raise FileExistsError(
                f"{', '.join(taken)} already hold MHLA weights; choose another folder or pass "
                "overwrite=True (CLI: --overwrite)"
            )
        for name, transformer in transformers.items():
            save_mhla(transformer, folder / name, include_base=include_base, overwrite=overwrite)
        return folder

    @property
    def transformer_components(self) -> dict[str, nn.Module]:
        """``{component name: transformer}`` of the transformers this pipeline holds, in
        :data:`TRANSFORMER_COMPONENTS` order (``transformer``; and ``transformer_2`` for Wan2.2-A14B)."""
        return {name: getattr(self, name) for name in TRANSFORMER_COMPONENTS if getattr(self, name, None) is not None}

    @property
    def mhla_conversions(self) -> dict[str, MHLAConversion | None]:
        """What MHLA changed in each transformer (``{name: conversion or None for softmax}``)."""
        return {name: get_mhla_conversion(transformer) for name, transformer in self.transformer_components.items()}

    @property
    def mhla(self) -> MHLAConversion | None:
        """What MHLA changed in the pipeline's transformers: ``None`` when none has MHLA layers, else their
        shared :class:`MHLAConversion` (a two-transformer pipeline converted with one config has one).

        Raises ``ValueError`` when the transformers differ (one MHLA and one softmax, or two configs): read
        :attr:`mhla_conversions` then.
        """
        conversions = self.mhla_conversions
        values = list(conversions.values())
        if all(value is None for value in values):
            return None
        if all(value is not None and value == values[0] for value in values):
            return values[0]
        described = "; ".join(f"{name}: {_describe(conversion)}" for name, conversion in conversions.items())
        raise ValueError(
            f"this pipeline's transformers differ in MHLA ({described}): read pipe.mhla_conversions for each one"
        )

    def convert_to_mhla(
        self, config: MHLAConfig | None = None, *, config_2: MHLAConfig | None = None
    ) -> dict[str, MHLAConversion]:
        """Convert the self-attention of every transformer of the pipeline to MHLA, in place.

        ``config`` (default :class:`MHLAConfig`) applies to every transformer; ``config_2``, when given, to
        ``transformer_2`` instead. Both are checked against their transformers before any is changed.
        Returns ``{name: conversion}`` (as :attr:`mhla_conversions`).
        """
        transformers = self.transformer_components
        if config_2 is not None and "transformer_2" not in transformers:
            raise ValueError("`config_2` is for pipelines with a transformer_2 (Wan2.2-A14B); this pipeline has none")
        converted = [name for name, conversion in self.mhla_conversions.items() if conversion is not None]
        if converted:
            raise ValueError(f"{' and '.join(converted)} already has MHLA layers: revert_mhla() it first")
        configs = {
            name: (config_2 if name == "transformer_2" and config_2 is not None else config) or MHLAConfig()
            for name in transformers
        }
        for name, transformer in transformers.items():
            resolve_mhla_config(transformer, configs[name])  # every config error before any change
        return {name: convert_transformer(transformer, configs[name]) for name, transformer in transformers.items()}

    @contextmanager
    def softmax_attention(self) -> Iterator[Any]:
        """Inside the block, generate with the original softmax self-attention of the same weights (in every
        transformer of the pipeline)."""
        with ExitStack() as stack:
            for transformer in self.transformer_components.values():
                stack.enter_context(softmax_attention(transformer))
            yield self


def _describe(conversion: MHLAConversion | None) -> str:
    if conversion is None:
        return "softmax"
    return f"MHLA on layers {conversion.layers}, layout {'x'.join(map(str, conversion.layout))}"


def _known_video_size(model: str | os.PathLike) -> dict[str, Any]:
    """The frames, size and frame rate a video model that records none is known by (a published Wan model's, an
    embedded model's; :func:`~mhla_diffusion.utils.model_defaults.video_defaults`), ``{}`` when unknown."""
    from ..utils.model_defaults import video_defaults

    defaults = video_defaults(model)
    if defaults.missing_size:
        return {}
    return {"num_frames": defaults.num_frames, "height": defaults.height, "width": defaults.width, "fps": defaults.fps}
