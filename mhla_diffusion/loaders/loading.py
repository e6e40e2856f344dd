"""Loading what the command line, the web app and the evaluation sampler run: one loader for all three.

* :func:`check_model_source`: a readable error for a local model folder that is not there, before
  anything loads (hub ids are left to the hub);
* :func:`local_labels`: the class names of a local DiT pipeline folder, read without loading it;
* :func:`device_and_dtype`: the device and weights dtype to run on (no side effects);
* :func:`load_transformer_file`: what ``--transformer`` names: an original-format Wan checkpoint
  file, or a Diffusers transformer folder with or without MHLA;
* :func:`load_pipeline`: an ``MHLAWanPipeline`` / ``MHLADiTPipeline`` from a model folder or hub id
  with MHLA weights or a replacement transformer.

Nothing here imports torch or Diffusers at import time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..utils.choices import ATTENTIONS
from ..utils.model_source import source_kind

__all__ = [
    "ATTENTIONS",
    "DIT_HUB_ID",
    "WAN_HUB_ID",
    "WAN_I2V_HUB_ID",
    "check_model_source",
    "device_and_dtype",
    "load_pipeline",
    "load_transformer_file",
    "local_labels",
]

#: The hub ids named in messages about missing model folders.
WAN_HUB_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN_I2V_HUB_ID = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
DIT_HUB_ID = "facebook/DiT-XL-2-256"


def check_model_source(model: str | os.PathLike, hub_id: str = WAN_HUB_ID, *, what: str = "model folder") -> None:
    """A readable ``FileNotFoundError`` when ``model`` looks like a local path but is not a folder.

    ``hub_id`` is the model suggested for download; ``what`` names the option in the message.
    """
    kind = source_kind(model)
    if kind in ("file", "missing"):
        problem = "is not a folder" if kind == "file" else "not found"
        raise FileNotFoundError(
            f"{what} {model} {problem}. Get the weights with `huggingface-cli download {hub_id} --local-dir "
            f"{model}` on a machine with internet, or pass the hub id `{hub_id}`"
        )


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


def load_transformer_file(path: str | os.PathLike, dtype: Any = None) -> Any:
    """A transformer from ``--transformer``: an original-format Wan checkpoint file (``.safetensors``,
    ``.pt``), a folder saved with MHLA (:func:`~mhla_diffusion.save_mhla` ``include_base``, ``mhla
    import-wan``), or a plain Diffusers transformer folder."""
    from .original_wan import load_original_wan
    from .weights import load_mhla, load_transformer, read_mhla_config

    path = Path(path)
    if path.is_file():
        return load_original_wan(path, dtype=dtype)
    if not path.is_dir():
        raise FileNotFoundError(f"--transformer {path} does not exist")
    if read_mhla_config(path) is not None:
        return load_mhla(path, dtype=dtype)
    return load_transformer(path, dtype=dtype)


def load_pipeline(
    cls: type,
    model: str | os.PathLike,
    *,
    mhla_weights: str | os.PathLike | None = None,
    mhla_weights_2: str | os.PathLike | None = None,
    transformer: str | os.PathLike | None = None,
    attention: str | None = "mhla",
    dtype: Any = None,
    component_dtypes: dict[str, Any] | None = None,
) -> Any:
    """Load ``cls`` (``MHLAWanPipeline`` / ``MHLAWanImageToVideoPipeline`` / ``MHLADiTPipeline``) from ``model``
    (a folder or hub id).

    Args:
        mhla_weights: a folder written by ``save_mhla`` / ``mhla convert --output``, applied to the
            pipeline's transformer (or, with ``transformer/`` and ``transformer_2/`` in it, to both
            transformers of a Wan2.2-A14B pipeline).
        mhla_weights_2: a ``save_mhla`` folder for ``transformer_2`` (Wan2.2-A14B).
        transformer: replaces the pipeline's ``transformer`` (see :func:`load_transformer_file`).
        attention: ``"mhla"``: every transformer of the pipeline must have MHLA layers (else ``ValueError``);
            ``"softmax"`` or ``None``: the model as it is (the caller runs softmax with ``pipe.softmax_attention()``).
        dtype: weights dtype; ``component_dtypes`` overrides it per component (e.g. ``{"vae": torch.float32}``).
    """
    if attention not in (*ATTENTIONS, None):
        raise ValueError(f"attention must be one of {ATTENTIONS} or None, got {attention!r}")
    kwargs: dict[str, Any] = {"dtype": {"default": dtype, **component_dtypes} if component_dtypes else dtype}
    if transformer is not None:
        kwargs["transformer"] = load_transformer_file(transformer, dtype)
    pipe = cls.from_pretrained(model, mhla_weights=mhla_weights, mhla_weights_2=mhla_weights_2, **kwargs)
    softmax = [name for name, conversion in pipe.mhla_conversions.items() if conversion is None]
    if attention == "mhla" and softmax:
        what = "the model has" if len(softmax) == len(pipe.mhla_conversions) else f"{' and '.join(softmax)} has"
        raise ValueError(
            f"--attention mhla, but {what} no MHLA layers: pass --mhla-weights (--mhla-weights-2 for transformer_2), "
            "a --transformer with MHLA, or a folder saved by our pipeline (use --attention softmax for the plain "
            "softmax model)"
        )
    return pipe
