"""The files of a saved MHLA folder once found: read them (one checkpoint reader, memory-mapped, ``weights_only``),
and load their tensors strictly into a transformer.

Finding a source's files, and deciding what the source is, is :mod:`mhla_diffusion.loaders.plan`'s job; the
folder format itself is described in :mod:`mhla_diffusion.loaders.weights`.
"""

from __future__ import annotations

import os
import re
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from safetensors import safe_open
from torch import nn

from ..config import MHLAConfig
from ..models.conversion import (
    build_mhla_processors,
    get_mhla_conversion,
    install_mhla_processors,
    self_attention_layers,
)
from ..models.families import family_of
from ..models.processors.base import kept_in_fp32
from ..models.processors.grid import TokenGridContext

__all__ = [
    "MHLA_CONFIG_NAME",
    "MHLA_WEIGHTS_NAME",
    "check_state_dict",
    "dtype_on_load",
    "hub_kwargs_of",
    "load_into",
    "model_shape",
    "WRAPPER_PREFIXES",
    "read_checkpoint_file",
    "read_safetensors_metadata",
    "read_state_dict",
    "strip_wrapper_prefix",
    "read_mhla_tensors",
]

MHLA_CONFIG_NAME = "mhla_config.json"
MHLA_WEIGHTS_NAME = "mhla_weights.safetensors"
FORMAT = "mhla-diffusion"
FORMAT_VERSION = 1
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download")
#: Prefixes a training wrapper puts on every key of a state dict: DDP's ``module.``, ``model.`` (wrapping
#: modules such as Lightning's), torch.compile's ``_orig_mod.``.
WRAPPER_PREFIXES = ("module.", "model.", "_orig_mod.")


def hub_kwargs_of(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The hub download options (``revision``, ``token``, ...) among ``from_pretrained`` keyword arguments."""
    return {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}


def model_shape(transformer: nn.Module) -> dict[str, Any]:
    layers = self_attention_layers(transformer)
    attn = layers[0][1]
    family = family_of(transformer)
    return {
        "family": family.name,
        "transformer_class": family.transformer_class_name,
        "num_layers": len(layers),
        "heads": int(attn.heads),
        "head_dim": int(attn.to_q.out_features // attn.heads),
    }


def read_mhla_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        # safetensors or a pickled Diffusers checkpoint (`.bin`, read with weights_only: tensors only)
        tensors.update(read_checkpoint_file(path, keep=lambda key: ".processor." in key))
    return tensors


def read_checkpoint_file(
    path: str | os.PathLike,
    *,
    mmap: bool = False,
    safe_globals: Sequence[type] = (),
    keep: Callable[[str], bool] | None = None,
) -> Any:
    """What one ``.safetensors`` or ``.pt``-style file holds, or a one-line ``ValueError`` naming the file.

    ``.safetensors``: its tensors. Any other file: ``torch.load`` with ``weights_only=True`` (``safe_globals`` names
    the only classes allowed besides tensors and plain values),
    memory-mapped with ``mmap`` where the file's format allows it (a legacy non-zip file is read whole, with a
    warning). A file of another kind, corrupt or truncated, is refused as such; objects other than tensors and
    plain values are refused and never loaded. ``keep``: when given, only the entries of a state dict whose
    keys it accepts (a safetensors file reads no other tensor).
    """
    path = Path(path)
    legacy = False
    with _refusing_unreadable(path):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                return {key: handle.get_tensor(key) for key in handle.keys() if keep is None or keep(key)}
        legacy = mmap and not zipfile.is_zipfile(path)
        with torch.serialization.safe_globals(list(safe_globals)):
            data = torch.load(path, map_location="cpu", mmap=mmap and not legacy, weights_only=True)
    if legacy:
        warnings.warn(
            f"{path} is in torch's legacy (non-zip) format, which cannot be memory-mapped: reading it whole; "
            "re-save it with torch.save to import it without a copy in memory",
            stacklevel=3,
        )
    if keep is not None and isinstance(data, dict):
        data = {key: value for key, value in data.items() if keep(key)}
    return data


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a ``.safetensors`` file (``{}`` when it has none), or a one-line ``ValueError`` naming it."""
    with _refusing_unreadable(Path(path)), safe_open(str(path), framework="pt", device="cpu") as handle:
        return dict(handle.metadata() or {})


@contextmanager
def _refusing_unreadable(path: Path) -> Iterator[None]:
    """Turn any failure to parse ``path`` into one line naming it (a missing or unreadable file keeps its own)."""
    try:
        yield
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 - bytes that are no checkpoint fail anywhere in the unpickler
        # torch's own message would advise weights_only=False; name the class instead, and load nothing
        unsupported = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if unsupported:
            raise ValueError(
                f"{path} holds objects other than tensors and plain values ({unsupported.group(1)}), "
                "which are not loaded"
            ) from None
        raise ValueError(f"{path} is not a readable PyTorch/safetensors checkpoint (corrupt or truncated?)") from None


def strip_wrapper_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` without the wrapper prefixes (:data:`WRAPPER_PREFIXES`, nested ones too) that every key shares."""
    state_dict = dict(state_dict)
    for prefix in WRAPPER_PREFIXES:
        if state_dict and all(key.startswith(prefix) for key in state_dict):
            return strip_wrapper_prefix({key[len(prefix) :]: value for key, value in state_dict.items()})
    return state_dict


def read_state_dict(
    path: str | os.PathLike,
    select: Callable[[Any, str], Any] | None = None,
    *,
    safe_globals: Sequence[type] = (),
) -> dict[str, torch.Tensor]:
    """The state dict in one checkpoint file, memory-mapped where the format allows (``safe_open``; ``torch.load``
    with ``mmap=True`` and ``weights_only=True``) and without its wrapper prefix (:func:`strip_wrapper_prefix`).

    ``select(data, where)`` picks the state dict from what the file holds (default: the file is one);
    anything but a mapping is a one-line ``ValueError`` naming the file.
    """
    data = read_checkpoint_file(path, mmap=True, safe_globals=safe_globals)
    chosen = select(data, os.fspath(path)) if select is not None else data
    if not isinstance(chosen, Mapping):
        raise ValueError(f"{os.fspath(path)} holds a {type(chosen).__name__}, not a state dict")
    return strip_wrapper_prefix(chosen)


def dtype_on_load(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype Diffusers' ``from_pretrained(dtype=dtype)`` gives ``model``'s floating tensor ``name``: float32
    inside the modules the class keeps in float32 (``_keep_in_fp32_modules``: Wan's RoPE, time embedder,
    norms, modulation tables) and for the MHLA parameters the processors keep in float32
    (:data:`~mhla_diffusion.models.processors.base.FP32_PARAMETERS`), ``dtype`` everywhere else."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    if any(part in keep for part in name.split(".")) or (kept_in_fp32(name) and dtype.itemsize < 4):
        return torch.float32
    return dtype


def check_model_matches(transformer: nn.Module, meta: dict[str, Any]) -> None:
    have = model_shape(transformer)
    wrong = {k: (meta[k], have[k]) for k in ("family", "num_layers", "heads", "head_dim") if meta.get(k) != have[k]}
    if wrong:
        details = ", ".join(f"{k}: saved {saved} vs model {model}" for k, (saved, model) in wrong.items())
        raise ValueError(
            f"MHLA weights do not fit this transformer ({details}); load them into the model they came from"
        )


def load_into(transformer: nn.Module, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Build processors from ``meta``, check ``tensors`` against them strictly, then install."""
    if get_mhla_conversion(transformer) is not None:
        raise ValueError(
            "this transformer is already converted to MHLA; load into an unconverted model or revert_mhla() first"
        )
    check_model_matches(transformer, meta)
    config = MHLAConfig.from_dict(meta["mhla_config"])
    context = TokenGridContext()
    # empty processors filled by assignment: the loaded tensors become the parameters (still memory-mapped
    # when the file holds the model's dtype), instead of initialising new ones and copying into them
    resolved, processors = build_mhla_processors(transformer, config, context, empty=True)
    expected = {
        f"{name}.processor.{key}": value
        for name, proc in processors.items()
        for key, value in proc.state_dict().items()
    }
    check_state_dict(expected, tensors, "MHLA weights do not match the model")
    layers = dict(self_attention_layers(transformer))
    for name, proc in processors.items():
        prefix, device = f"{name}.processor.", layers[name].to_q.weight.device
        own = {
            key: tensors[prefix + key].to(device=device, dtype=value.dtype) for key, value in proc.state_dict().items()
        }
        proc.load_state_dict(own, strict=True, assign=True)
    install_mhla_processors(transformer, resolved, processors, context)


def check_state_dict(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor], problem: str) -> None:
    """Raise ``ValueError(problem: ...)`` listing missing, unexpected and wrongly shaped keys of ``given``."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    wrong_shape = sorted(
        f"{key}: saved {tuple(given[key].shape)} vs model {tuple(expected[key].shape)}"
        for key in set(expected) & set(given)
        if given[key].shape != expected[key].shape
    )
    raise_key_mismatch(problem, {"missing keys": missing, "unexpected keys": unexpected, "wrong shapes": wrong_shape})


def raise_key_mismatch(problem: str, found: dict[str, list[str]]) -> None:
    """Raise ``ValueError(problem: missing keys [...]; ...)`` naming the non-empty key lists of ``found`` (by label)."""
    listed = [f"{label} {sorted(keys)}" for label, keys in found.items() if keys]
    if listed:
        raise ValueError(f"{problem}: " + "; ".join(listed))
