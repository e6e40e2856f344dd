"""Save and load MHLA weights: safetensors plus a JSON config.

Two forms of a folder, both with ``mhla_config.json`` (the resolved :class:`MHLAConfig` and the
shape of the model it belongs to):

* MHLA only (default): ``mhla_weights.safetensors`` holds just the processors' parameters, keyed as
  in the transformer (``blocks.3.attn1.processor.mixing``). Load into a base model from anywhere.
* Whole transformer (``include_base=True``): Diffusers' ``save_pretrained`` files (``config.json``,
  ``diffusion_pytorch_model*.safetensors``, processor parameters included) next to the config.

Loading is strict: missing, unexpected or wrongly shaped keys are an error that lists them, raised
before the model is changed (Diffusers itself would only warn and drop unknown processor keys).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import MHLAConfig
from .conversion import (
    build_mhla_processors,
    get_mhla_conversion,
    install_mhla_processors,
    mhla_parameter_names,
    model_family,
    self_attention_layers,
)
from .processors.grid import TokenGridContext

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

MHLA_CONFIG_NAME = "mhla_config.json"
MHLA_WEIGHTS_NAME = "mhla_weights.safetensors"
_FORMAT = "mhla-diffusion"
_FORMAT_VERSION = 1
_DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
_DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download")


def _model_shape(transformer: nn.Module) -> dict[str, Any]:
    layers = self_attention_layers(transformer)
    attn = layers[0][1]
    return {
        "family": model_family(transformer),
        "transformer_class": {"wan": "WanTransformer3DModel", "dit": "DiTTransformer2DModel"}[model_family(transformer)],
        "num_layers": len(layers),
        "heads": int(attn.heads),
        "head_dim": int(attn.to_q.out_features // attn.heads),
    }


def save_mhla(
    transformer: nn.Module,
    save_directory: str | os.PathLike,
    *,
    include_base: bool = False,
    overwrite: bool = False,
) -> Path:
    """Save the MHLA parameters (or, with ``include_base``, the whole converted transformer).

    Existing files are never replaced unless ``overwrite=True``. Returns the folder.
    """
    conversion = get_mhla_conversion(transformer)
    if conversion is None:
        raise ValueError("the transformer is not converted to MHLA: call convert_to_mhla(transformer, config) first")
    folder = Path(save_directory)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"`save_directory` {folder} exists and is not a folder")
    planned = [MHLA_CONFIG_NAME] + (["config.json", _DIFFUSERS_WEIGHTS, _DIFFUSERS_INDEX] if include_base else [MHLA_WEIGHTS_NAME])
    existing = [name for name in planned if (folder / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{folder} already holds {existing}; choose another folder or pass overwrite=True (CLI: --overwrite)"
        )
    folder.mkdir(parents=True, exist_ok=True)

    if include_base:
        transformer.save_pretrained(folder, safe_serialization=True)
    else:
        state = transformer.state_dict()
        tensors = {key: state[key].detach().contiguous().cpu() for key in mhla_parameter_names(transformer)}
        save_file(tensors, str(folder / MHLA_WEIGHTS_NAME), metadata={"format": "pt", "producer": _FORMAT})
    write_mhla_config(transformer, folder, contents="transformer" if include_base else "mhla")
    return folder


def write_mhla_config(transformer: nn.Module, folder: str | os.PathLike, contents: str = "transformer") -> Path:
    """Write ``mhla_config.json`` for a converted ``transformer`` into ``folder``.

    ``contents`` says where the MHLA parameters are: ``"transformer"`` (in the Diffusers weights
    files beside it, e.g. after ``save_pretrained``) or ``"mhla"`` (in ``mhla_weights.safetensors``).
    """
    conversion = get_mhla_conversion(transformer)
    if conversion is None:
        raise ValueError("the transformer is not converted to MHLA")
    if contents not in ("transformer", "mhla"):
        raise ValueError(f"`contents` must be 'transformer' or 'mhla', got {contents!r}")
    meta = {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "contents": contents,
        **_model_shape(transformer),
        "layer_names": conversion.layer_names,
        "mhla_config": conversion.config.to_dict(),
    }
    path = Path(folder) / MHLA_CONFIG_NAME
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


def read_mhla_config(source: str | os.PathLike, subfolder: str | None = None, **hub_kwargs: Any) -> dict[str, Any] | None:
    """The ``mhla_config.json`` of a folder or hub repo as a dict (``None`` when there is none).

    Cheap: lets callers check the block layout against a requested size before loading any model.
    """
    return _read_meta(source, subfolder, hub_kwargs, required=False)


def _find_file(source: str | os.PathLike, filename: str, subfolder: str | None, hub_kwargs: dict[str, Any]) -> Path | None:
    """Path of ``filename`` in a local folder or a hub repo (downloaded to the cache), or ``None``."""
    if os.path.isdir(source):
        path = Path(source, subfolder or "", filename)
        return path if path.is_file() else None
    text = str(source)
    if os.path.exists(text) or os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") != 1:
        raise FileNotFoundError(f"{source} is neither a local folder nor a hub repo id of the form 'owner/name'")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(text, filename, subfolder=subfolder, **hub_kwargs))
    except (EntryNotFoundError, LocalEntryNotFoundError):  # absent, or not cached while offline
        return None


def _read_meta(
    source: str | os.PathLike, subfolder: str | None, hub_kwargs: dict[str, Any], required: bool = True
) -> dict[str, Any] | None:
    path = _find_file(source, MHLA_CONFIG_NAME, subfolder, hub_kwargs)
    if path is None:
        if not required:
            return None
        where = f"{source}/{subfolder}" if subfolder else str(source)
        raise FileNotFoundError(f"no {MHLA_CONFIG_NAME} in {where}: point to a folder written by save_mhla")
    meta = json.loads(path.read_text())
    if meta.get("format") != _FORMAT or meta.get("format_version", 0) > _FORMAT_VERSION:
        raise ValueError(f"{path} is not an mhla-diffusion config this version can read (format {meta.get('format')!r})")
    return meta


def _weight_files(
    source: str | os.PathLike, meta: dict[str, Any], subfolder: str | None, variant: str | None, hub_kwargs: dict[str, Any]
) -> list[Path]:
    """The safetensors file(s) that hold the MHLA parameters of a saved folder."""
    if meta["contents"] == "mhla":
        names = [MHLA_WEIGHTS_NAME]
    else:
        weights, index = _DIFFUSERS_WEIGHTS, _DIFFUSERS_INDEX
        if variant:
            weights = weights.replace(".safetensors", f".{variant}.safetensors")
            index = index.replace(".safetensors.index", f".{variant}.safetensors.index")
        index_path = _find_file(source, index, subfolder, hub_kwargs)
        if index_path is not None:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = sorted({f for key, f in weight_map.items() if ".processor." in key})
        else:
            names = [weights]
    files = []
    for name in names:
        path = _find_file(source, name, subfolder, hub_kwargs)
        if path is None:
            raise FileNotFoundError(f"{name} is missing from {source}: the MHLA folder is incomplete")
        files.append(path)
    return files


def _read_mhla_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if ".processor." in key:
                    tensors[key] = f.get_tensor(key)
    return tensors


def _check_model_matches(transformer: nn.Module, meta: dict[str, Any]) -> None:
    have = _model_shape(transformer)
    wrong = {k: (meta[k], have[k]) for k in ("family", "num_layers", "heads", "head_dim") if meta.get(k) != have[k]}
    if wrong:
        details = ", ".join(f"{k}: saved {saved} vs model {model}" for k, (saved, model) in wrong.items())
        raise ValueError(f"MHLA weights do not fit this transformer ({details}); load them into the model they came from")


def _load_into(transformer: nn.Module, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Build processors from ``meta``, check ``tensors`` against them strictly, then install."""
    if get_mhla_conversion(transformer) is not None:
        raise ValueError("this transformer is already converted to MHLA; load into an unconverted model or revert_mhla() first")
    _check_model_matches(transformer, meta)
    config = MHLAConfig.from_dict(meta["mhla_config"])
    context = TokenGridContext()
    resolved, processors = build_mhla_processors(transformer, config, context)
    expected = {f"{name}.processor.{key}": value for name, proc in processors.items() for key, value in proc.state_dict().items()}
    check_state_dict(expected, tensors, "MHLA weights do not match the model")
    for name, proc in processors.items():
        prefix = f"{name}.processor."
        proc.load_state_dict({key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}, strict=True)
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
    found = [(label, keys) for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                                 ("wrong shapes", wrong_shape)) if keys]
    if found:
        raise ValueError(f"{problem}: " + "; ".join(f"{label} {keys}" for label, keys in found))


@contextmanager
def _quiet_about_processor_keys(cls: type) -> Iterator[None]:
    """Let Diffusers' ``from_pretrained`` skip ``.processor.`` keys silently; we load them ourselves."""
    had_own = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    old = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    inherited = getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []
    cls._keys_to_ignore_on_load_unexpected = list(inherited) + [r"\.processor\."]
    try:
        yield
    finally:
        if had_own:
            cls._keys_to_ignore_on_load_unexpected = old
        else:
            del cls._keys_to_ignore_on_load_unexpected


def load_mhla(
    source: str | os.PathLike,
    transformer: nn.Module | None = None,
    *,
    subfolder: str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Load MHLA weights saved by :func:`save_mhla` from a local folder or a hub repo id.

    * ``load_mhla(folder, transformer)``: convert ``transformer`` (a base model of the same shape)
      with the saved config and load the MHLA parameters; works with both folder forms.
    * ``load_mhla(folder)``: the folder holds a whole converted transformer: load it with Diffusers'
      ``from_pretrained`` (``kwargs`` such as ``dtype`` pass through), then its MHLA parameters;
      the model comes back as :class:`MHLAWanTransformer3DModel` / :class:`MHLADiTTransformer2DModel`.

    Returns the converted transformer. Any key mismatch raises ``ValueError`` listing the keys.
    """
    if transformer is None:
        from .models import mhla_transformer_class

        meta = _read_meta(source, subfolder, {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
        if meta["contents"] != "transformer":
            raise ValueError(
                f"{source} holds only MHLA parameters: pass the base transformer too, load_mhla(folder, transformer)"
            )
        return mhla_transformer_class(meta["family"]).from_pretrained(source, subfolder=subfolder, **kwargs)
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    meta = _read_meta(source, subfolder, hub_kwargs)
    tensors = _read_mhla_tensors(_weight_files(source, meta, subfolder, kwargs.get("variant"), hub_kwargs))
    _load_into(transformer, meta, tensors)
    return transformer


def from_pretrained_keeping_mhla(
    cls: type, base_from_pretrained: Any, source: str | os.PathLike, subfolder: str | None = None, **kwargs: Any
) -> nn.Module:
    """Diffusers' ``from_pretrained`` (``base_from_pretrained``) plus the MHLA layers a folder declares.

    Without an ``mhla_config.json`` beside the weights this is the plain Diffusers load. With one,
    the checkpoint's ``.processor.`` keys are loaded strictly into freshly built MHLA processors
    instead of being dropped with a warning.
    """
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    meta = _read_meta(source, subfolder, hub_kwargs, required=False)
    # Weights left memory-mapped by `from_pretrained` made CPU outputs differ from the saved model
    # in the last bit (seen with diffusers 0.42); reading the file into memory keeps reloads exact.
    kwargs.setdefault("disable_mmap", True)
    if meta is None:
        return base_from_pretrained(source, subfolder=subfolder, **kwargs)
    if meta["contents"] != "transformer":
        raise ValueError(f"{source} holds only MHLA parameters; load the base model, then load_mhla(folder, transformer)")
    with _quiet_about_processor_keys(cls):
        transformer = base_from_pretrained(source, subfolder=subfolder, **kwargs)
    tensors = _read_mhla_tensors(_weight_files(source, meta, subfolder, kwargs.get("variant"), hub_kwargs))
    _load_into(transformer, meta, tensors)
    return transformer


# Hub DiT checkpoints (facebook/DiT-XL-2-256) still record the legacy class name.
_TRANSFORMER_CLASSES = {
    "WanTransformer3DModel": "WanTransformer3DModel",
    "DiTTransformer2DModel": "DiTTransformer2DModel",
    "Transformer2DModel": "DiTTransformer2DModel",
}


def load_transformer(source: str | os.PathLike, *, subfolder: str | None = None, **kwargs: Any) -> nn.Module:
    """Load a base Wan or DiT transformer from a local folder or hub id with Diffusers' ``from_pretrained``.

    ``source`` may be a transformer folder or a whole pipeline folder (then ``subfolder`` defaults
    to ``"transformer"``). ``kwargs`` (``dtype``, ``revision``, ...) pass through.
    """
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    if subfolder is None and _find_file(source, "model_index.json", None, hub_kwargs) is not None:
        subfolder = "transformer"
    config_path = _find_file(source, "config.json", subfolder, hub_kwargs)
    if config_path is None:
        where = f"{source}/{subfolder}" if subfolder else str(source)
        raise FileNotFoundError(f"no config.json in {where}: give a Diffusers transformer or pipeline folder (or hub id)")
    class_name = json.loads(config_path.read_text()).get("_class_name")
    if class_name not in _TRANSFORMER_CLASSES:
        raise ValueError(
            f"{source} holds a {class_name!r}; MHLA supports WanTransformer3DModel and DiTTransformer2DModel"
        )
    import diffusers

    cls = getattr(diffusers, _TRANSFORMER_CLASSES[class_name])
    kwargs.setdefault("disable_mmap", True)  # exact CPU numerics, see load_mhla
    return cls.from_pretrained(source, subfolder=subfolder, **kwargs)
