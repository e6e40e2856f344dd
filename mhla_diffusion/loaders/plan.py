"""One load plan per model source: what a local folder, a file or a hub id holds, decided once, then loaded.

Every entry point that loads a model (the ``mhla`` commands, the web demo, the trainers, evaluation, the
library's ``from_pretrained`` / ``load_mhla`` / ``load_transformer``) resolves its sources here first:

* :func:`resolve_source` turns one source into a :class:`LoadPlan`: its kind (``folder``, ``file``, ``hub``), what
  it holds (:data:`PlanForm`: a pipeline, a transformer, MHLA weights, MHLA weights per transformer, an
  original-format checkpoint), the transformer class and family, the MHLA setting (``None``: softmax), the
  dtype asked for, the files read to decide, and for a pipeline or a per-transformer MHLA folder a plan per
  transformer component. Each file of a source is looked up once (a hub file is fetched once, into the cache);
  the loaders read the plan and never decide again what kind of folder they have.
* :func:`plan_pipeline` is the plan of a pipeline load: the pipeline, which MHLA weights go into which of its
  transformers, and a replacement transformer, all checked against each other before anything loads.
* :meth:`LoadPlan.describe` says what a source is, for error messages ("a WanPipeline pipeline folder whose
  transformer has no MHLA layers").

While a pipeline loads, :func:`plans_in_use` lends its component plans to the MHLA transformer classes'
``from_pretrained`` (which Diffusers calls per component), so they are not resolved a second time.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping

from ..models.conversion import MHLA_CONFIG_KEY
from ..models.families import family_for_class_name
from ..utils.model_source import SourceKind, source_kind
from .hub_failures import hub_failure
from .weight_files import (
    DIFFUSERS_INDEX,
    DIFFUSERS_WEIGHTS,
    FORMAT,
    FORMAT_VERSION,
    MHLA_CONFIG_NAME,
    MHLA_WEIGHTS_NAME,
    hub_kwargs_of,
    raise_key_mismatch,
)

__all__ = [
    "LoadPlan",
    "PipelinePlan",
    "PlanForm",
    "TRANSFORMER_COMPONENTS",
    "find_file",
    "from_pretrained_keeping_mhla",
    "mhla_weight_plans",
    "plan_pipeline",
    "plans_in_use",
    "read_mhla_config",
    "resolve_source",
]

#: The pipeline components that can hold a transformer. Wan2.2-A14B has both: ``transformer`` runs the
#: steps with timestep >= ``boundary_ratio`` x 1000, ``transformer_2`` the others.
TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")

#: What a source holds. ``pipeline``: a Diffusers pipeline (``model_index.json``); ``transformer``: a Diffusers
#: transformer folder of a supported family (with or without MHLA); ``mhla-weights``: MHLA parameters only
#: (``save_mhla``); ``mhla-per-transformer``: ``transformer/`` and ``transformer_2/`` MHLA folders (what
#: ``mhla convert`` writes for Wan2.2-A14B); ``checkpoint``: an original-format checkpoint (a file, or a local
#: folder of shards); ``unknown``: none of these.
PlanForm = Literal["pipeline", "transformer", "mhla-weights", "mhla-per-transformer", "checkpoint", "unknown"]


def find_file(
    source: str | os.PathLike, filename: str, subfolder: str | None, hub_kwargs: Mapping[str, Any]
) -> Path | None:
    """Path of ``filename`` in a local folder or a hub repo (downloaded to the cache), or ``None``: the plan's own
    lookup rule, for one file outside a plan (inside one, :class:`_Files` looks each file up once)."""
    return _Files(source, source_kind(source), dict(hub_kwargs)).find(filename, subfolder)


class _Files:
    """The files of one source, each looked up once (a hub file fetched once); remembers a hub repo the hub could
    not give (offline and not cached, unreachable), so that a plan that finds nothing can say so."""

    def __init__(self, source: str | os.PathLike, kind: SourceKind, hub_kwargs: dict[str, Any]):
        self.source, self.kind, self.hub_kwargs = source, kind, hub_kwargs
        self._found: dict[tuple[str | None, str], Path | None] = {}
        self._json: dict[tuple[str | None, str], Any] = {}
        self.unavailable: BaseException | None = None

    def find(self, filename: str, subfolder: str | None = None) -> Path | None:
        key = (subfolder, filename)
        if key not in self._found:
            self._found[key] = self._lookup(filename, subfolder)
        return self._found[key]

    def json(self, filename: str, subfolder: str | None = None) -> Any:
        """The parsed JSON file, or ``None`` when the source has no such file."""
        key = (subfolder, filename)
        if key not in self._json:
            path = self.find(filename, subfolder)
            self._json[key] = json.loads(path.read_text()) if path is not None else None
        return self._json[key]

    def found(self) -> dict[str, Path]:
        """``{"subfolder/name": path}`` of every file looked up and found."""
        return {"/".join(filter(None, key)): path for key, path in self._found.items() if path is not None}

    def _lookup(self, filename: str, subfolder: str | None) -> Path | None:
        if self.kind == "folder":
            path = Path(self.source, subfolder or "", filename)
            return path if path.is_file() else None
        if self.kind != "hub":
            raise FileNotFoundError(
                f"{self.source} is neither a local folder nor a hub repo id of the form 'owner/name'"
            )
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        try:
            return Path(hf_hub_download(os.fspath(self.source), filename, subfolder=subfolder, **self.hub_kwargs))
        except LocalEntryNotFoundError as error:  # not cached while offline, or the hub unreachable
            self.unavailable = self.unavailable or error
            return None
        except EntryNotFoundError:  # the repo has no such file
            return None


@dataclass(frozen=True)
class LoadPlan:
    """What one model source holds, resolved once by :func:`resolve_source`.

    ``mhla`` is the MHLA description of a transformer or MHLA-weights source in the form of ``mhla_config.json``
    (``contents``, ``family``, ``num_layers``, ``heads``, ``head_dim``, ``mhla_config``), ``None`` for softmax
    (and for pipelines: their ``components`` say it per transformer). ``files``: the files read to decide
    (``"transformer/config.json"`` -> path), local or in the hub cache.
    """

    source: str | os.PathLike
    kind: SourceKind
    form: PlanForm
    subfolder: str | None = None
    class_name: str | None = None
    family: str | None = None
    mhla: Mapping[str, Any] | None = None
    dtype: Any = None
    #: The source's ``config.json`` (``None`` for a pipeline, a file, or a folder without one).
    config: Mapping[str, Any] | None = None
    index: Mapping[str, Any] | None = None
    components: Mapping[str, LoadPlan] = field(default_factory=dict)
    files: Mapping[str, Path] = field(default_factory=dict)
    hub_kwargs: Mapping[str, Any] = field(default_factory=dict)
    _files: _Files | None = field(default=None, repr=False, compare=False)

    @property
    def where(self) -> str:
        """The source and subfolder, as messages name it."""
        return f"{os.fspath(self.source)}/{self.subfolder}" if self.subfolder else os.fspath(self.source)

    @property
    def directory(self) -> Path | None:
        """The folder the plan's files are in (a local folder, or the hub cache's copy); ``None`` for a file."""
        if self.kind == "file":
            return None
        if self.kind == "folder":
            return Path(self.source, self.subfolder or "")
        prefix = f"{self.subfolder}/" if self.subfolder else ""
        own = [path.parent for name, path in self.files.items() if "/" not in name.removeprefix(prefix)]
        return own[0] if own else None

    @property
    def has_mhla(self) -> bool:
        """Whether loading this source gives MHLA layers (a pipeline: in every transformer)."""
        if self.form == "pipeline":
            return bool(self.components) and all(plan.mhla is not None for plan in self.components.values())
        return self.mhla is not None

    def with_dtype(self, dtype: Any) -> LoadPlan:
        """The same plan, loading in ``dtype``."""
        return replace(self, dtype=dtype, components={k: v.with_dtype(dtype) for k, v in self.components.items()})

    def describe(self) -> str:
        """What the source is, in words: ``"a WanPipeline pipeline folder (transformer: WanTransformer3DModel
        without MHLA layers)"``."""
        where = {"folder": "folder", "hub": "hub repo", "file": "file"}[self.kind]
        if self.form == "pipeline":
            parts = [f"{name}: {plan.class_name} {plan._mhla_words()}" for name, plan in self.components.items()]
            inside = f" ({'; '.join(parts)})" if parts else " (no transformer)"
            return f"a {self.class_name or 'Diffusers'} pipeline {where}{inside}"
        if self.form == "transformer":
            return f"a {self.class_name} transformer {where} {self._mhla_words()}"
        if self.form == "mhla-weights":
            assert self.mhla is not None
            return (
                f"an MHLA weights {where} (save_mhla) for a {self.mhla.get('family')} transformer of "
                f"{self.mhla.get('num_layers')} layers"
            )
        if self.form == "mhla-per-transformer":
            return f"an MHLA weights {where} with {' and '.join(f'{name}/' for name in self.components)}"
        if self.form == "checkpoint":
            return "an original-format checkpoint file" if self.kind == "file" else f"a {where} of checkpoint shards"
        if self.class_name is not None:
            return f"a {where} holding a {self.class_name!r} (not a transformer MHLA supports)"
        return f"a {where} with none of model_index.json, config.json or {MHLA_CONFIG_NAME}"

    def _mhla_words(self) -> str:
        if self.mhla is None:
            return "without MHLA layers"
        layout = self.mhla.get("mhla_config", {}).get("layout")
        shown = f" (layout {'x'.join(map(str, layout))})" if isinstance(layout, (list, tuple)) else ""
        return f"with MHLA layers{shown}"

    def subplan(self, subfolder: str) -> LoadPlan:
        """The plan of ``subfolder`` of this folder or repo (a pipeline's component plan when it has one), its
        files looked up by the same once-only lookups."""
        if subfolder in self.components:
            return self.components[subfolder]
        if self._files is None:
            raise ValueError(f"{self.where} is {self.describe()}: it has no subfolder {subfolder!r}")
        return _resolve(self._files, subfolder, self.dtype)

    def component_config(self, component: str, required: bool = False) -> dict[str, Any] | None:
        """The ``config.json`` of pipeline component ``component`` (e.g. ``"vae"``), read once; ``None`` (or, when
        ``required``, ``FileNotFoundError``) when the pipeline has none."""
        if self.form != "pipeline" or self._files is None:
            raise ValueError(f"{self.where} is {self.describe()}, not a pipeline: it has no components")
        config = self._files.json("config.json", component)
        if config is None and required:
            raise FileNotFoundError(f"{self.where} has no {component}/config.json: it is {self.describe()}")
        return dict(config) if config is not None else None

    def mhla_weight_files(self, variant: str | None = None) -> list[Path]:
        """The safetensors (or ``.bin``) file(s) holding the MHLA parameters of an MHLA source."""
        if self.mhla is None or self._files is None:
            raise ValueError(f"{self.where} is {self.describe()}: it holds no MHLA parameters")
        find = self._files.find
        if self.mhla["contents"] == "mhla":
            names = [MHLA_WEIGHTS_NAME]
        else:
            weights, index = DIFFUSERS_WEIGHTS, DIFFUSERS_INDEX
            if variant:
                weights = weights.replace(".safetensors", f".{variant}.safetensors")
                index = index.replace(".safetensors.index", f".{variant}.safetensors.index")
            index_path = find(index, self.subfolder)
            if index_path is None and find(weights, self.subfolder) is None:
                # save_pretrained(safe_serialization=False) writes .bin files
                weights, index = weights.replace(".safetensors", ".bin"), index.replace(".safetensors", ".bin")
                index_path = find(index, self.subfolder)
            if index_path is not None:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                names = sorted({name for key, name in weight_map.items() if ".processor." in key})
            else:
                names = [weights]
        files = []
        for name in names:
            path = find(name, self.subfolder)
            if path is None:
                raise FileNotFoundError(f"{name} is missing from {self.where}: the MHLA folder is incomplete")
            files.append(path)
        return files


def resolve_source(
    source: str | os.PathLike | LoadPlan, subfolder: str | None = None, *, dtype: Any = None, **hub_kwargs: Any
) -> LoadPlan:
    """The :class:`LoadPlan` of ``source`` (a local folder or file, or a hub id; a plan is returned as it is,
    with ``dtype`` when given). ``hub_kwargs``: ``revision``, ``token``, ``cache_dir``, ``local_files_only``,
    ``force_download``.

    Reads only the small files that decide (``model_index.json``, ``config.json``, ``mhla_config.json``, the
    transformers' in a pipeline). Raises ``FileNotFoundError`` for a local path with nothing there, and
    :class:`~mhla_diffusion.loaders.loading.ModelUnavailable` for a hub id the hub cannot give.
    """
    if isinstance(source, LoadPlan):
        return source.with_dtype(dtype) if dtype is not None else source
    kind = source_kind(source)
    if kind == "missing":
        raise FileNotFoundError(
            f"{os.fspath(source)} is neither a local folder nor a hub repo id of the form 'owner/name': nothing is "
            "there; give a local folder or checkpoint file, or a hub id"
        )
    if kind == "file":
        if subfolder:
            raise ValueError(f"{os.fspath(source)} is a file: it has no subfolder {subfolder!r}")
        return LoadPlan(source, kind, "checkpoint", dtype=dtype, files={"checkpoint": Path(source)})
    files = _Files(source, kind, hub_kwargs_of(hub_kwargs))
    plan = _resolve(files, subfolder, dtype)
    if plan.form == "unknown" and plan.class_name is None and files.unavailable is not None:
        failure = hub_failure(files.unavailable, {os.fspath(source): ""})
        if failure is None:
            raise files.unavailable
        raise failure from files.unavailable  # the cause lets hub_errors name the option that gave the id
    return plan


def _resolve(files: _Files, subfolder: str | None, dtype: Any) -> LoadPlan:
    def plan(form: PlanForm, **fields: Any) -> LoadPlan:
        return LoadPlan(
            files.source, files.kind, form, subfolder, dtype=dtype, hub_kwargs=files.hub_kwargs, _files=files, **fields
        )

    if subfolder is None:
        index = files.json("model_index.json")
        if index is not None:
            components = {
                name: _resolve(files, name, dtype) for name in TRANSFORMER_COMPONENTS if _declared(index, name)
            }
            return _with_files(
                plan("pipeline", class_name=index.get("_class_name"), index=index, components=components)
            )
    found = files.json("config.json", subfolder)
    config = found or {}
    class_name = config.get("_class_name")
    family = family_for_class_name(class_name)
    meta = _meta_of_model_config(config, family) if family is not None else None
    if meta is None:
        meta = _read_mhla_config_file(files, subfolder)
    if meta is not None and meta["contents"] == "mhla":
        return _with_files(
            plan("mhla-weights", class_name=meta.get("transformer_class"), family=meta["family"], mhla=meta)
        )
    if family is not None or meta is not None:  # an older whole-transformer folder carries mhla_config.json
        name = family.name if family is not None else meta["family"]
        shown = class_name if family is not None else meta.get("transformer_class")
        return _with_files(plan("transformer", class_name=shown, family=name, mhla=meta, config=found))
    if subfolder is None and not config:
        per_transformer = {
            name: _resolve(files, name, dtype)
            for name in TRANSFORMER_COMPONENTS
            if files.find(MHLA_CONFIG_NAME, name) is not None
        }
        if per_transformer:
            return _with_files(plan("mhla-per-transformer", components=per_transformer))
        if files.kind == "folder" and _holds_checkpoint(Path(files.source)):
            return _with_files(plan("checkpoint"))
    return _with_files(plan("unknown", class_name=class_name, config=found))


def _with_files(plan: LoadPlan) -> LoadPlan:
    """``plan`` listing the files looked up for it (its own and its components')."""
    assert plan._files is not None
    prefix = f"{plan.subfolder}/" if plan.subfolder else ""
    return replace(plan, files={k: v for k, v in plan._files.found().items() if k.startswith(prefix)})


def _declared(index: Mapping[str, Any], name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] is not None


def _holds_checkpoint(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json"))


def _meta_of_model_config(config: Mapping[str, Any], family: Any) -> dict[str, Any] | None:
    """The MHLA description made from the ``mhla`` entry of a transformer's ``config.json`` (``None`` without one):
    the whole transformer, MHLA parameters included, is in the Diffusers weights beside it."""
    setting = config.get(MHLA_CONFIG_KEY)
    if not isinstance(setting, dict):
        return None
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "contents": "transformer",
        "family": family.name,
        "transformer_class": family.transformer_class_name,
        # Flux / HunyuanVideo count their double-stream, then their single-stream blocks
        "num_layers": sum(
            config.get(key) or 0 for key in ("num_layers", "num_single_layers")[: len(family.attention_sites)]
        ),
        "heads": config.get("num_attention_heads"),
        "head_dim": config.get("attention_head_dim"),
        "mhla_config": setting,
    }


def _read_mhla_config_file(files: _Files, subfolder: str | None) -> dict[str, Any] | None:
    meta = files.json(MHLA_CONFIG_NAME, subfolder)
    if meta is None:
        return None
    if meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{files.find(MHLA_CONFIG_NAME, subfolder)} is not an mhla-diffusion config this version can read "
            f"(format {meta.get('format')!r})"
        )
    return meta


def read_mhla_config(
    source: str | os.PathLike, subfolder: str | None = None, **hub_kwargs: Any
) -> dict[str, Any] | None:
    """The MHLA description of a saved transformer or MHLA-weights folder (or hub repo) in the form of
    ``mhla_config.json``; ``None`` when it has none. Cheap: lets callers check the block layout against a requested
    size before loading any model."""
    mhla = resolve_source(source, subfolder, **hub_kwargs).mhla
    return dict(mhla) if mhla is not None else None


# ----------------------------------------------------------------------------- a pipeline load


@dataclass(frozen=True)
class PipelinePlan:
    """The plan of a pipeline load (:func:`plan_pipeline`): the pipeline, the MHLA weights per transformer
    component, and a transformer that replaces the pipeline's ``transformer``."""

    model: LoadPlan
    mhla_weights: Mapping[str, LoadPlan] = field(default_factory=dict)
    transformer: LoadPlan | None = None
    #: The transformer components the loaded pipeline will hold.
    transformers: tuple[str, ...] = ()

    def known_before_loading(self, name: str) -> bool:
        """Whether the plan knows if transformer component ``name`` will have MHLA layers: not for an original-format
        checkpoint replacing ``transformer`` (its keys say it once it is read)."""
        return not (name == "transformer" and self.transformer is not None and self.transformer.form == "checkpoint")

    def mhla_of(self, name: str) -> Mapping[str, Any] | None:
        """The MHLA description of transformer component ``name`` once loaded (``None``: softmax, or not known
        before loading: :meth:`known_before_loading`)."""
        if name in self.mhla_weights:
            return self.mhla_weights[name].mhla
        if name == "transformer" and self.transformer is not None:
            return self.transformer.mhla
        own = self.model.components.get(name)
        return own.mhla if own is not None else None

    def declared_mhla(self) -> list[Mapping[str, Any]]:
        """The MHLA descriptions of the loaded pipeline's transformers that have MHLA layers."""
        return [meta for meta in map(self.mhla_of, self.transformers) if meta is not None]

    def weights_folder(self, name: str) -> str | None:
        """The folder component ``name``'s MHLA weights come from (``None``: none given)."""
        plan = self.mhla_weights.get(name)
        return plan.where if plan is not None else None


def plan_pipeline(
    model: str | os.PathLike | LoadPlan,
    mhla_weights: str | os.PathLike | LoadPlan | None = None,
    mhla_weights_2: str | os.PathLike | LoadPlan | None = None,
    transformer: str | os.PathLike | LoadPlan | None = None,
    *,
    dtype: Any = None,
    overrides: Mapping[str, Any] | None = None,
    **hub_kwargs: Any,
) -> PipelinePlan:
    """The plan of loading pipeline ``model`` (folder or hub id) with MHLA weights and a replacement transformer.

    ``mhla_weights``: a ``save_mhla`` folder for ``transformer`` (or one with ``transformer/`` and
    ``transformer_2/``); ``mhla_weights_2``: one for ``transformer_2``; ``transformer``: an original Wan
    checkpoint or a transformer folder replacing ``transformer``. ``overrides``: components passed to
    ``from_pretrained`` (``transformer_2=None`` drops it). Every mismatch is an error naming the fix, before
    any model loads. ``hub_kwargs`` (``revision``, ``token``, ...) are ``model``'s.
    """
    pipeline = resolve_source(model, dtype=dtype, **hub_kwargs)
    if pipeline.form != "pipeline":
        raise ValueError(
            f"{pipeline.where} is {pipeline.describe()}, not a pipeline: give a Diffusers pipeline folder or hub "
            "id (one with model_index.json)"
        )
    overrides = overrides or {}
    transformers = tuple(
        name
        for name in TRANSFORMER_COMPONENTS
        if ((overrides[name] is not None) if name in overrides else name in pipeline.components)
    )
    replacement = None
    if transformer is not None:
        replacement = resolve_source(transformer, dtype=dtype)
        if replacement.form not in ("transformer", "checkpoint"):
            raise ValueError(
                f"--transformer {replacement.where} is {replacement.describe()}: give an original Wan checkpoint "
                "or a Diffusers transformer folder"
            )
    weights = mhla_weight_plans(mhla_weights, mhla_weights_2, transformers)  # the hub options are the model's
    return PipelinePlan(pipeline, weights, replacement, transformers)


def mhla_weight_plans(
    mhla_weights: str | os.PathLike | LoadPlan | None,
    mhla_weights_2: str | os.PathLike | LoadPlan | None,
    transformers: tuple[str, ...] | list[str],
    **hub_kwargs: Any,
) -> dict[str, LoadPlan]:
    """``{transformer component: plan of its MHLA weights}`` for ``mhla_weights`` / ``mhla_weights_2`` in a
    pipeline whose transformer components are ``transformers``. Raises ``FileNotFoundError`` / ``ValueError``
    naming the fix when a folder holds no MHLA weights, when weights name a transformer the pipeline lacks, or
    when a two-transformer pipeline would get MHLA in only one of them."""
    plans: dict[str, LoadPlan] = {}
    if mhla_weights is None and mhla_weights_2 is None:
        return plans
    if mhla_weights is not None:
        given = resolve_source(mhla_weights, **hub_kwargs)
        if given.form == "mhla-per-transformer":
            plans = dict(given.components)
        elif given.mhla is not None:
            plans["transformer"] = given
        else:
            raise FileNotFoundError(
                f"mhla_weights {given.where} is {given.describe()}: no {MHLA_CONFIG_NAME} in it (nor in its "
                "transformer/ or transformer_2/): give a folder written by save_mhla or `mhla convert --output`"
            )
    if mhla_weights_2 is not None:
        if "transformer_2" in plans:
            raise ValueError(f"mhla_weights {mhla_weights} already holds transformer_2/: leave out mhla_weights_2")
        second = resolve_source(mhla_weights_2, **hub_kwargs)
        if second.mhla is None:
            raise FileNotFoundError(
                f"mhla_weights_2 {second.where} is {second.describe()}: no {MHLA_CONFIG_NAME} in it; give a folder "
                "written by save_mhla or `mhla convert --output`"
            )
        plans["transformer_2"] = second
    absent = [name for name in plans if name not in transformers]
    if absent:
        raise ValueError(
            f"MHLA weights for {' and '.join(absent)}, but the pipeline has no {' and '.join(absent)} "
            f"(its transformers: {', '.join(transformers) or 'none'})"
        )
    left = [name for name in transformers if name not in plans]
    if left:
        raise ValueError(
            f"this pipeline has two transformers ({', '.join(transformers)}), but MHLA weights were given only for "
            f"{', '.join(plans)}: pass mhla_weights_2=<folder> for transformer_2 (CLI: --mhla-weights-2), or "
            "mhla_weights=<folder with transformer/ and transformer_2/> "
            "(what `mhla convert` writes for such a pipeline)"
        )
    return plans


# ----------------------------------------------------------------------------- plans lent to Diffusers' loading

_LENT: ContextVar[tuple[LoadPlan, ...]] = ContextVar("mhla_lent_plans", default=())


@contextmanager
def plans_in_use(plan: LoadPlan) -> Iterator[None]:
    """Inside the block, the transformer plans of pipeline ``plan`` answer the MHLA transformer classes'
    ``from_pretrained`` (which Diffusers calls per component with the component's folder)."""
    lent = tuple(plan.components.values()) if plan.form == "pipeline" else (plan,)
    token = _LENT.set(_LENT.get() + lent)
    try:
        yield
    finally:
        _LENT.reset(token)


def _lent_plan(source: str | os.PathLike, subfolder: str | None) -> LoadPlan | None:
    """The lent plan for ``source`` / ``subfolder`` (by source id or by folder on disk), else ``None``."""
    lent = _LENT.get()
    folder = Path(source, subfolder or "").resolve() if lent and source_kind(source) == "folder" else None
    for plan in lent:
        if os.fspath(plan.source) == os.fspath(source) and plan.subfolder == subfolder:
            return plan
        if folder is not None and plan.directory is not None and plan.directory.resolve() == folder:
            return plan
    return None


def from_pretrained_keeping_mhla(
    base_from_pretrained: Callable[..., Any], source: str | os.PathLike, subfolder: str | None = None, **kwargs: Any
) -> Any:
    """Diffusers' ``from_pretrained`` of an MHLA transformer class (``base_from_pretrained``), whose ``mhla``
    config entry rebuilds the MHLA processors before Diffusers loads their parameters, with two additions:

    * a folder written before ``config.json`` held the setting gets it from its ``mhla_config.json``;
    * MHLA parameters the checkpoint lacks, or holds for layers the setting does not name, are a ``ValueError``
      listing them (Diffusers would only warn, and leave missing ones uninitialised).

    ``load_plan``: the source's :class:`LoadPlan` when the caller has it (else a plan lent by
    :func:`plans_in_use`, else resolved here).
    """
    plan = kwargs.pop("load_plan", None) or _lent_plan(source, subfolder)
    if plan is None:
        plan = resolve_source(source, subfolder, **hub_kwargs_of(kwargs))
    if plan.form == "mhla-weights":
        raise ValueError(
            f"{plan.where} is {plan.describe()}: it holds only MHLA parameters; load the base model, then "
            "load_mhla(folder, transformer) (or pipe.load_mhla_weights(folder))"
        )
    if plan.mhla is not None:
        kwargs.setdefault(MHLA_CONFIG_KEY, plan.mhla["mhla_config"])
    with_info = kwargs.pop("output_loading_info", False)
    model, info = base_from_pretrained(source, subfolder=subfolder, output_loading_info=True, **kwargs)
    raise_key_mismatch(
        f"the MHLA parameters in {plan.where} do not match its MHLA setting",
        {
            f"{kind} keys": [key for key in info[f"{kind}_keys"] if ".processor." in key]
            for kind in ("missing", "unexpected")
        },
    )
    return (model, info) if with_info else model
