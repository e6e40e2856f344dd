"""LoRA files of MHLA models: a mark in the safetensors metadata saying the adapter was trained on
MHLA layers, written by the trainer and checked by :meth:`MHLAWanPipeline.load_lora_weights`.

A stock Diffusers loader ignores the mark: it loads such a file into softmax attention without a
word, and the output is off (the adapter learnt corrections for MHLA, not for softmax).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..loaders.weight_files import read_checkpoint_file, read_safetensors_metadata
from ..models.conversion import MHLAConversion

__all__ = ["LORA_WEIGHT_NAME", "MARK_PREFIX", "check_lora_mark", "lora_file", "mark_mhla_lora", "read_lora_mark"]

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
MARK_PREFIX = "mhla_diffusion."


def mark_mhla_lora(path: str | os.PathLike, conversion: MHLAConversion | None) -> None:
    """Add the MHLA mark to the metadata of the LoRA file ``path`` (existing metadata is kept).

    ``conversion`` is the trained model's (``None``: a softmax model, marked ``requires_mhla: false``)."""
    from safetensors.torch import save_file

    path = Path(path)
    metadata = read_safetensors_metadata(path)
    metadata[MARK_PREFIX + "requires_mhla"] = "true" if conversion is not None else "false"
    if conversion is not None:
        metadata[MARK_PREFIX + "mhla_layers"] = json.dumps(list(conversion.layer_names))
        metadata[MARK_PREFIX + "layout"] = json.dumps(list(conversion.layout))
    tensors = read_checkpoint_file(path)
    temporary = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temporary), metadata=metadata)
    os.replace(temporary, path)


def lora_file(source: Any, weight_name: str | None = None, subfolder: str | None = None) -> Path | None:
    """The local LoRA file ``load_lora_weights`` reads for ``source`` (``None``: a dict or a hub id)."""
    if isinstance(source, dict) or source is None:
        return None
    path = Path(source)
    if path.is_file():
        return path
    if path.is_dir():
        folder = path / subfolder if subfolder else path
        candidate = folder / (weight_name or LORA_WEIGHT_NAME)
        return candidate if candidate.is_file() else None
    return None


def read_lora_mark(path: str | os.PathLike) -> dict[str, Any]:
    """The MHLA mark of a LoRA file: ``{}`` for a file without one (any other trainer's)."""
    metadata = read_safetensors_metadata(path)
    if MARK_PREFIX + "requires_mhla" not in metadata:
        return {}
    mark: dict[str, Any] = {"requires_mhla": metadata[MARK_PREFIX + "requires_mhla"] == "true"}
    for key in ("mhla_layers", "layout"):
        if MARK_PREFIX + key in metadata:
            mark[key] = json.loads(metadata[MARK_PREFIX + key])
    return mark


def check_lora_mark(path: str | os.PathLike, conversion: MHLAConversion | None) -> None:
    """Raise ``ValueError`` when the LoRA file ``path`` was trained on MHLA layers that the model lacks."""
    mark = read_lora_mark(path)
    if not mark.get("requires_mhla"):
        return
    layers, layout = mark.get("mhla_layers"), mark.get("layout")
    if conversion is None:
        raise ValueError(
            f"{path} is a LoRA trained on MHLA layers ({len(layers or [])} layers, layout {layout}), "
            "but this pipeline's "
            "transformer uses softmax attention: load the MHLA weights first (MHLAWanPipeline.from_pretrained(base, "
            "mhla_weights=<the run's final folder>)); loaded into softmax attention its output would be off"
        )
    if layers is not None and list(layers) != list(conversion.layer_names):
        raise ValueError(
            f"{path} is a LoRA trained on MHLA layers {layers}, but this pipeline's transformer has MHLA on "
            f"{list(conversion.layer_names)}: load the MHLA weights of the same run"
        )
    if layout is not None and list(layout) != list(conversion.layout):
        raise ValueError(
            f"{path} is a LoRA trained with the MHLA block layout {layout}, but this pipeline's transformer uses "
            f"{list(conversion.layout)}: load the MHLA weights of the same run"
        )
