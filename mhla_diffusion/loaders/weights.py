"""Save and load MHLA weights.

Two forms of a folder:

* MHLA only (default): ``mhla_weights.safetensors`` holds just the processors' parameters, keyed as
  in the transformer (``blocks.3.attn1.processor.mixing``), beside ``mhla_config.json`` (the resolved
  :class:`MHLAConfig` and the shape of the model it belongs to). Load into a base model from anywhere
  (``load_mhla(folder, transformer)``, ``pipe.load_mhla_weights(folder)``).
* Whole transformer (``include_base=True``): Diffusers' own ``save_pretrained`` folder (``config.json`` with
  the MHLA setting in its ``mhla`` entry, ``diffusion_pytorch_model*.safetensors`` with the processor
  parameters), which ``MHLAWanTransformer3DModel`` / ``MHLADiTTransformer2DModel.from_pretrained`` reload.
  Folders written before ``config.json`` held the setting carry an ``mhla_config.json`` instead, and still load.

Loading is lean: Diffusers' ``from_pretrained`` memory-maps the safetensors files and the model's
weights stay in the mapped pages (private, copy-on-write: training never writes into the files), so
a load takes no second copy of the weights; pass ``dtype=`` to load in that dtype (a file that holds
it is not converted), and ``disable_mmap=True`` to read the files into memory instead (e.g. for files
on a network drive that may change while the model is in use). ``mhla bench --load`` measures it.

Loading is strict: missing, unexpected or wrongly shaped MHLA keys are an error that lists them (Diffusers
itself would only warn and drop unknown processor keys, or leave missing ones uninitialised).
Reading the files is :mod:`mhla_diffusion.loaders.weight_files` (shared with :mod:`mhla_diffusion.models.transformers`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from ..models.conversion import get_mhla_conversion, mhla_parameter_names, sync_mhla_config
from ..models.families import FAMILIES, family_named
from .plan import LoadPlan, from_pretrained_keeping_mhla, read_mhla_config, resolve_source
from .weight_files import (
    DIFFUSERS_INDEX,
    DIFFUSERS_WEIGHTS,
    FORMAT,
    FORMAT_VERSION,
    MHLA_CONFIG_NAME,
    MHLA_WEIGHTS_NAME,
    check_state_dict,
    hub_kwargs_of,
    load_into,
    model_shape,
    read_mhla_tensors,
)

__all__ = [
    "MHLA_CONFIG_NAME",
    "MHLA_WEIGHTS_NAME",
    "from_pretrained_keeping_mhla",
    "load_mhla",
    "load_transformer",
    "check_state_dict",
    "read_mhla_config",
    "save_mhla",
    "write_mhla_config",
]


def save_mhla(
    transformer: nn.Module,
    save_directory: str | os.PathLike,
    *,
    include_base: bool = False,
    overwrite: bool = False,
) -> Path:
    """Save the MHLA parameters (or, with ``include_base``, the whole converted transformer: Diffusers'
    ``save_pretrained``, whose ``config.json`` holds the MHLA setting).

    Existing files are never replaced unless ``overwrite=True``. Returns the folder.
    """
    conversion = get_mhla_conversion(transformer)
    if conversion is None:
        raise ValueError("the transformer is not converted to MHLA: call convert_to_mhla(transformer, config) first")
    folder = Path(save_directory)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"`save_directory` {folder} exists and is not a folder")
    planned = (
        ["config.json", DIFFUSERS_WEIGHTS, DIFFUSERS_INDEX] if include_base else [MHLA_CONFIG_NAME, MHLA_WEIGHTS_NAME]
    )
    existing = [name for name in planned if (folder / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{folder} already holds {existing}; choose another folder or pass overwrite=True (CLI: --overwrite)"
        )
    folder.mkdir(parents=True, exist_ok=True)

    if include_base:
        sync_mhla_config(transformer)  # the stock classes' save_pretrained does not
        transformer.save_pretrained(folder, safe_serialization=True)
    else:
        state = transformer.state_dict()
        tensors = {key: state[key].detach().contiguous().cpu() for key in mhla_parameter_names(transformer)}
        save_file(tensors, str(folder / MHLA_WEIGHTS_NAME), metadata={"format": "pt", "producer": FORMAT})
        write_mhla_config(transformer, folder, contents="mhla")
    written = {folder / name for name in planned} | set(folder.glob("*.safetensors"))  # shards too
    for path in written:  # safetensors writes 0600: give the files the mode the umask gives any new file
        if path.is_file():
            os.chmod(path, _new_file_mode())
    return folder


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file under the process's umask (0644 under umask 022)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_mhla_config(transformer: nn.Module, folder: str | os.PathLike, contents: str = "transformer") -> Path:
    """Write ``mhla_config.json`` for a converted ``transformer`` into ``folder``.

    ``contents`` says where the MHLA parameters are: ``"mhla"`` (in ``mhla_weights.safetensors``) or
    ``"transformer"`` (in the Diffusers weights files beside it: what older releases wrote after
    ``save_pretrained``; ``config.json``'s ``mhla`` entry says it now).
    """
    conversion = get_mhla_conversion(transformer)
    if conversion is None:
        raise ValueError("the transformer is not converted to MHLA")
    if contents not in ("transformer", "mhla"):
        raise ValueError(f"`contents` must be 'transformer' or 'mhla', got {contents!r}")
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "contents": contents,
        **model_shape(transformer),
        "layer_names": conversion.layer_names,
        "mhla_config": conversion.config.to_dict(),
    }
    path = Path(folder) / MHLA_CONFIG_NAME
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


def load_mhla(
    source: str | os.PathLike | LoadPlan,
    transformer: nn.Module | None = None,
    *,
    subfolder: str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Load MHLA weights saved by :func:`save_mhla` from a local folder or a hub repo id (or its
    :class:`~mhla_diffusion.loaders.plan.LoadPlan`).

    * ``load_mhla(folder, transformer)``: convert ``transformer`` (a base model of the same shape)
      with the saved config and load the MHLA parameters; works with both folder forms.
    * ``load_mhla(folder)``: the folder holds a whole converted transformer: load it with Diffusers'
      ``from_pretrained`` (``kwargs`` such as ``dtype`` pass through), then its MHLA parameters;
      the model comes back as :class:`MHLAWanTransformer3DModel` / :class:`MHLADiTTransformer2DModel`.

    Returns the converted transformer. Any key mismatch raises ``ValueError`` listing the keys.
    """
    plan = resolve_source(source, subfolder, **hub_kwargs_of(kwargs))
    kwargs = {**plan.hub_kwargs, **kwargs}  # a plan's revision, token, ... load with it
    if transformer is None:
        if plan.mhla is None:
            raise FileNotFoundError(
                f"{plan.where} is {plan.describe()} (no `mhla` entry in its config.json, no {MHLA_CONFIG_NAME}): it "
                "holds no MHLA layers; load a plain Diffusers transformer folder "
                "(e.g. one `mhla import-dit` wrote for an original DiT) with load_transformer(folder)"
            )
        if plan.form != "transformer":
            raise ValueError(
                f"{plan.where} holds only MHLA parameters: pass the base transformer too, "
                "load_mhla(folder, transformer)"
            )
        if plan.dtype is not None:
            kwargs.setdefault("dtype", plan.dtype)
        cls = family_named(plan.family).mhla_transformer_class()
        return cls.from_pretrained(plan.source, subfolder=plan.subfolder, load_plan=plan, **kwargs)
    if plan.mhla is None:
        raise FileNotFoundError(
            f"{plan.where} is {plan.describe()}: no {MHLA_CONFIG_NAME} in it (nor an `mhla` entry in a "
            "config.json): point to a folder written by save_mhla or save_pretrained of a converted transformer"
        )
    load_into(transformer, dict(plan.mhla), read_mhla_tensors(plan.mhla_weight_files(kwargs.get("variant"))))
    return transformer


def load_transformer(source: str | os.PathLike | LoadPlan, *, subfolder: str | None = None, **kwargs: Any) -> nn.Module:
    """Load a base transformer of a supported family (:data:`~mhla_diffusion.models.families.FAMILIES`) from a local
    folder or hub id (or its :class:`~mhla_diffusion.loaders.plan.LoadPlan`) with Diffusers' ``from_pretrained``.

    ``source`` may be a transformer folder or a whole pipeline folder (its ``transformer``). ``kwargs``
    (``dtype``, ``revision``, ...) pass through.
    """
    plan = resolve_source(source, subfolder, **hub_kwargs_of(kwargs))
    kwargs = {**plan.hub_kwargs, **kwargs}
    if plan.form == "pipeline":
        plan = plan.subplan("transformer")
    if plan.form != "transformer":
        supported = ", ".join(f.transformer_class_name for f in FAMILIES.values())
        if plan.form == "unknown" and plan.class_name is None:
            raise FileNotFoundError(
                f"no config.json in {plan.where} ({plan.describe()}): give a Diffusers transformer or pipeline folder "
                "(or hub id)"
            )
        raise ValueError(f"{plan.where} is {plan.describe()}; MHLA supports {supported}")
    if plan.dtype is not None:
        kwargs.setdefault("dtype", plan.dtype)
    import diffusers

    from ..models.transformers import apply_timestep_freq_shift, shift_applied_quietly

    cls = family_named(plan.family).transformer_class()
    with shift_applied_quietly():
        transformer = cls.from_pretrained(plan.source, subfolder=plan.subfolder, **kwargs)
    if isinstance(transformer, diffusers.DiTTransformer2DModel):
        apply_timestep_freq_shift(transformer)  # e.g. 0 in a folder written by `mhla import-dit`
    return transformer
