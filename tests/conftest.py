"""Shared fixtures: tiny Wan / DiT transformers built from configs and inputs for them."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from mhla_diffusion.tiny import tiny_dit_transformer, tiny_wan_transformer

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def tiny_wan():
    """A 3-layer tiny WanTransformer3DModel (fresh per test)."""
    return tiny_wan_transformer(num_layers=3)


@pytest.fixture
def tiny_dit():
    """A 2-layer tiny DiTTransformer2DModel (fresh per test)."""
    return tiny_dit_transformer(num_layers=2)


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


@pytest.fixture
def wan_batch():
    return wan_inputs()


@pytest.fixture
def dit_batch():
    return dit_inputs()


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


# ----------------------------------------------------------------------------- tiny pipelines on disk


@pytest.fixture(scope="session")
def pipeline_dirs(tmp_path_factory):
    """Tiny Wan and DiT pipelines saved to disk, with MHLA weights folders for them.

    Keys: ``wan`` / ``dit`` (stock Diffusers pipeline folders), ``wan_mhla`` / ``dit_mhla``
    (``save_mhla`` folders; Wan with a (2, 2, 2) layout, DiT with its auto 2x2 layout).
    """
    from mhla_diffusion import MHLAConfig, convert_to_mhla, save_mhla
    from mhla_diffusion.tiny import TINY_ID2LABEL, tiny_dit_pipeline, tiny_wan_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    wan = tiny_wan_pipeline()
    wan.save_pretrained(root / "wan")
    convert_to_mhla(wan.transformer, MHLAConfig(layout=(2, 2, 2), gate=True))
    with torch.no_grad():
        wan.transformer.blocks[0].attn1.processor.mixing.mul_(1.5)
    save_mhla(wan.transformer, root / "wan_mhla")

    dit = tiny_dit_pipeline()
    dit.register_to_config(id2label=TINY_ID2LABEL)  # so the stock pipeline saves it
    dit.save_pretrained(root / "dit")
    convert_to_mhla(dit.transformer, MHLAConfig(lepe=True))
    save_mhla(dit.transformer, root / "dit_mhla")
    return {name: root / name for name in ("wan", "wan_mhla", "dit", "dit_mhla")}


#: Small, fast text-to-video call arguments for the tiny Wan pipeline.
WAN_CALL = dict(
    prompt="a red circle moving left", negative_prompt="blue", height=32, width=32, num_frames=9,
    num_inference_steps=2, max_sequence_length=16, output_type="np",
)


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)
