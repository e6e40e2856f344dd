"""Inputs for the tiny Wan / DiT transformers of :mod:`mhla_diffusion.models.tiny`, running them, and
pipeline folders that record generation defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def wan_inputs(frames: int = 3, height: int = 8, width: int = 10, batch: int = 1, seed: int = 0) -> dict:
    """Keyword inputs of the tiny Wan model for a token grid of ``frames x height x width``."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, 16, frames, 2 * height, 2 * width, generator=g),
        timestep=torch.full((batch,), 500),
        encoder_hidden_states=torch.randn(batch, 7, 32, generator=g),
    )


def dit_inputs(batch: int = 2, seed: int = 0) -> dict:
    """Keyword inputs of the tiny DiT model (8x8 latent -> 4x4 token grid)."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, 4, 8, 8, generator=g),
        timestep=torch.arange(batch) * 100 + 10,
        class_labels=torch.arange(batch) + 1,
    )


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The model's output sample for keyword ``inputs``, without gradients."""
    with torch.no_grad():
        return model(**inputs).sample


#: Small, fast text-to-video call arguments for the tiny Wan pipeline.
WAN_CALL = dict(
    prompt="a red circle moving left",
    negative_prompt="blue",
    height=32,
    width=32,
    num_frames=9,
    num_inference_steps=2,
    max_sequence_length=16,
    output_type="np",
)


def seeded(seed: int = 0) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator("cpu").manual_seed(seed)


def with_record(folder: Path, target: Path, record: dict) -> Path:
    """A copy of pipeline ``folder`` at ``target`` whose ``model_index.json`` records ``record`` as its generation
    defaults (:data:`~mhla_diffusion.utils.model_defaults.RECORD_KEY`); ``target``."""
    from mhla_diffusion.utils.model_defaults import RECORD_KEY

    shutil.copytree(folder, target)
    index = json.loads((target / "model_index.json").read_text())
    index[RECORD_KEY] = record
    (target / "model_index.json").write_text(json.dumps(index))
    return target
