"""Loading what the command line, the web app and the evaluation sampler run: one loader for all three.

Every load here starts from a plan (:mod:`mhla_diffusion.loaders.plan`: each source resolved once).

* :func:`check_model_source`: a readable error for a local model folder that is not there, before
  anything loads (hub ids are left to the hub);
* :func:`hub_errors` / :func:`hub_failure` (:mod:`mhla_diffusion.loaders.hub_failures`): the one rule for a model
  id the hub cannot give (unreachable, offline and not cached, no such repo or file, gated): one
  :class:`ModelUnavailable` line naming the id, the component and what to do. Every entry point that loads (the
  ``mhla`` commands, the trainers, evaluation, the web demo) runs its loading inside :func:`hub_errors`;
* :func:`local_labels`: the class names of a local DiT pipeline folder, read without loading it;
* :func:`device_and_dtype`: the device and weights dtype to run on (no side effects);
* :func:`load_transformer_file`: what ``--transformer`` names: an original-format Wan checkpoint
  file, or a Diffusers transformer folder with or without MHLA;
* :func:`load_pipeline`: an ``MHLAWanPipeline`` / ``MHLADiTPipeline`` from a model folder or hub id (or the
  load's :class:`~mhla_diffusion.loaders.plan.PipelinePlan`) with MHLA weights or a replacement transformer.

Nothing here imports torch or Diffusers at import time.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..utils.choices import ATTENTIONS
from ..utils.model_source import source_kind
from .hub_failures import ModelUnavailable, hub_errors, hub_failure

__all__ = [
    "ATTENTIONS",
    "DIT_HUB_ID",
    "WAN_HUB_ID",
    "WAN_I2V_HUB_ID",
    "ModelUnavailable",
    "check_hub_model",
    "check_hub_models",
    "check_model_source",
    "device_and_dtype",
    "hub_errors",
    "hub_failure",
    "model_names",
    "load_pipeline",
    "load_transformer_file",
    "local_labels",
]

#: The hub ids named in messages about missing model folders.
WAN_HUB_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN_I2V_HUB_ID = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
DIT_HUB_ID = "facebook/DiT-XL-2-256"


def check_model_source(
    model: str | os.PathLike, hub_id: str = WAN_HUB_ID, *, what: str = "model folder", revision: str | None = None
) -> None:
    """A readable ``FileNotFoundError`` when ``model`` looks like a local path but is not a folder; for a hub id,
    its config fetched (or found in the cache) first: :class:`ModelUnavailable` when the hub cannot give it.

    ``hub_id`` is the model suggested for download; ``what`` names the option in the message.
    """
    kind = source_kind(model)
    if kind == "hub":
        check_hub_model(os.fspath(model), what, revision)
        return
    if kind in ("file", "missing"):
        problem = "is not a folder" if kind == "file" else "not found"
        raise FileNotFoundError(
            f"{what} {model} {problem}. Get the weights with `hf download {hub_id} --local-dir "
            f"{model}` on a machine with internet, or pass the hub id `{hub_id}`"
        )


#: The options (argparse ``dest`` / trainer field names) that name a model folder or hub id to load.
MODEL_OPTIONS = frozenset(
    {
        "model",
        "pipeline",
        "softmax_model",
        "t2v_model",
        "c2i_model",
        "t2v_softmax_model",
        "c2i_softmax_model",
        "long_model",
        "pretrained_model",
        "vae_model",
    }
)


def model_names(values: Mapping[str, Any], prefix: str = "--") -> dict[str, str]:
    """``{model id: option}`` of the options in ``values`` (parsed arguments, trainer options) that name a
    model: ``model``, ``t2v_model``, ``pretrained_model``, ``vae_model``, ... (``prefix`` ``--``: written as flags)."""
    names = {}
    for key, value in values.items():
        if key in MODEL_OPTIONS and isinstance(value, str) and value:
            names[value] = f"{prefix}{key.replace('_', '-')}" if prefix else key
    return names


def check_hub_model(model: str, what: str | None = None, revision: str | None = None) -> None:
    """Fetch hub model ``model``'s ``model_index.json`` (a pipeline) or ``config.json`` (a model) into the cache,
    before anything loads: :class:`ModelUnavailable` (one line, :func:`hub_failure`; ``what``: the option that
    named it) when the hub cannot give it. A repo with neither file is left to the loader to describe."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    not_cached = None
    for name in ("model_index.json", "config.json"):  # a cached model offline has one of them in the cache
        try:
            hf_hub_download(model, name, revision=revision)
            return
        except LocalEntryNotFoundError as error:  # not cached, and the hub switched off or not reachable
            not_cached = not_cached or error
        except EntryNotFoundError:  # the repo has no such file: try the other
            continue
        except Exception as error:  # gated, no such repo, ...
            raise hub_failure(error, {model: what} if what else None) or error from None
    if not_cached is not None:
        failure = hub_failure(not_cached, {model: what} if what else None, file="model_index.json or config.json")
        raise failure or not_cached from None


def check_hub_models(names: Mapping[str, str]) -> None:
    """:func:`check_hub_model` for every hub id among ``names`` (``{model id: option}``, :func:`model_names`)."""
    for model, option in names.items():
        if source_kind(model) == "hub":
            check_hub_model(model, option)


def local_labels(model: str | os.PathLike) -> tuple[dict[str, int], int] | None:
    """``(name -> class id, number of classes)`` of a local DiT pipeline folder, read without loading it.

    ``None`` when ``model`` is not a local pipeline folder (e.g. a hub id).
    """
    index, config = Path(model, "model_index.json"), Path(model, "transformer", "config.json")
    if not (index.is_file() and config.is_file()):
        return None
    from ..pipelines.class_labels import label_index

    id2label = json.loads(index.read_text()).get("id2label")
    return label_index(id2label), int(json.loads(config.read_text()).get("num_embeds_ada_norm") or 1000)


def device_and_dtype(device: str | None = None, dtype: str | None = None) -> tuple[str, Any]:
    """``(device, torch dtype)``: cuda when available, bfloat16 on GPU and float32 on CPU unless given."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return device, getattr(torch, name)


def load_transformer_file(path: Any, dtype: Any = None) -> Any:
    """A transformer from ``--transformer`` (a path or its :class:`~mhla_diffusion.loaders.plan.LoadPlan`): an
    original-format Wan checkpoint file (``.safetensors``, ``.pt``), a folder saved with MHLA
    (:func:`~mhla_diffusion.save_mhla` ``include_base``, ``mhla import-wan``), or a plain Diffusers transformer
    folder."""
    from .original_wan import load_original_wan
    from .plan import LoadPlan, resolve_source
    from .weights import load_mhla, load_transformer

    if not isinstance(path, LoadPlan) and source_kind(path) not in ("file", "folder"):
        raise FileNotFoundError(f"--transformer {path} does not exist")
    plan = resolve_source(path, dtype=dtype)
    if plan.form == "checkpoint" and plan.kind == "file":
        return load_original_wan(plan.files["checkpoint"], dtype=plan.dtype)
    if plan.form == "transformer" and plan.mhla is not None:
        return load_mhla(plan)
    if plan.form == "transformer":
        return load_transformer(plan)
    raise ValueError(
        f"--transformer {plan.where} is {plan.describe()}: give an original Wan checkpoint file or a Diffusers "
        "transformer folder"
    )


@contextmanager
def _no_loading_bars() -> Iterator[None]:
    """Diffusers' and transformers' progress bars off while a pipeline loads from disk (nested bars that leave
    half-drawn lines before the generation's own bar); the hub's download bars stay."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    restore = []
    for library in (diffusers_logging, transformers_logging):
        if not library.is_progress_bar_enabled():
            continue
        library.disable_progress_bar()
        restore.append(library)
    try:
        yield
    finally:
        for library in restore:
            library.enable_progress_bar()


def load_pipeline(
    cls: type,
    model: Any,
    *,
    mhla_weights: str | os.PathLike | None = None,
    mhla_weights_2: str | os.PathLike | None = None,
    transformer: str | os.PathLike | None = None,
    attention: str | None = "mhla",
    dtype: Any = None,
    component_dtypes: dict[str, Any] | None = None,
) -> Any:
    """Load ``cls`` (``MHLAWanPipeline`` / ``MHLAWanImageToVideoPipeline`` / ``MHLADiTPipeline``) from ``model``
    (a folder or hub id, or the :class:`~mhla_diffusion.loaders.plan.PipelinePlan` of the load: then the three
    source arguments below are the plan's and are not given).

    Args:
        mhla_weights: a folder written by ``save_mhla`` / ``mhla convert --output``, applied to the
            pipeline's transformer (or, with ``transformer/`` and ``transformer_2/`` in it, to both
            transformers of a Wan2.2-A14B pipeline).
        mhla_weights_2: a ``save_mhla`` folder for ``transformer_2`` (Wan2.2-A14B).
        transformer: replaces the pipeline's ``transformer`` (see :func:`load_transformer_file`).
        attention: ``"mhla"``: every transformer of the pipeline must have MHLA layers (else ``ValueError``,
            before any model loads); ``"softmax"`` or ``None``: the model as it is (the caller runs softmax with
            ``pipe.softmax_attention()``).
        dtype: weights dtype; ``component_dtypes`` overrides it per component (e.g. ``{"vae": torch.float32}``).
    """
    from .plan import PipelinePlan, plan_pipeline

    if attention not in (*ATTENTIONS, None):
        raise ValueError(f"attention must be one of {ATTENTIONS} or None, got {attention!r}")
    if isinstance(model, PipelinePlan):
        if (mhla_weights, mhla_weights_2, transformer) != (None, None, None):
            raise ValueError("load_pipeline: give the MHLA weights and transformer in the plan, not beside it")
        plan = model
    else:
        plan = plan_pipeline(model, mhla_weights, mhla_weights_2, transformer, dtype=dtype)
    if attention == "mhla":  # what the plan knows, before any model loads
        _require_mhla(plan, [n for n in plan.transformers if plan.known_before_loading(n) and plan.mhla_of(n) is None])
    kwargs: dict[str, Any] = {"dtype": {"default": dtype, **component_dtypes} if component_dtypes else dtype}
    if plan.transformer is not None:
        kwargs["transformer"] = load_transformer_file(plan.transformer, dtype)
    with _no_loading_bars():
        pipe = cls.from_pretrained(plan.model.source, load_plan=plan, **plan.model.hub_kwargs, **kwargs)
    if attention == "mhla":  # and what an original-format checkpoint turned out to hold
        _require_mhla(plan, [name for name, conversion in pipe.mhla_conversions.items() if conversion is None])
    return pipe


def _require_mhla(plan: Any, softmax: list[str]) -> None:
    """``ValueError`` for ``--attention mhla`` when the transformers ``softmax`` of ``plan``'s pipeline have no MHLA
    layers."""
    if not softmax:
        return
    what = "the model has" if len(softmax) == len(plan.transformers) else f"{' and '.join(softmax)} has"
    raise ValueError(
        f"--attention mhla, but {what} no MHLA layers ({plan.model.where} is {plan.model.describe()}): pass "
        "--mhla-weights (--mhla-weights-2 for transformer_2), a --transformer with MHLA, or a folder saved by our "
        "pipeline (use --attention softmax for the plain softmax model)"
    )
