"""``MHLAConfig()`` converts every model family of :data:`~mhla_diffusion.models.families.FAMILIES`: without a
``target_grid``, the ``auto`` layout is chosen for the family's default token grid (its row's ``default_grid``:
Wan: the grid of its published default video size under the model's patch size; DiT: ``sample_size / patch``),
and the conversion says which grid and layout it chose."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers.models import run, wan_inputs
from mhla_diffusion import MHLAConfig, auto_layout, convert_to_mhla, video_token_grid
from mhla_diffusion.cli import main
from mhla_diffusion.models.conversion import self_attention_layers
from mhla_diffusion.models.families import FAMILIES
from mhla_diffusion.models.tiny import tiny_wan_transformer

#: The families with their own size rules (Wan, DiT); the others' default grids: tests/conversion/test_more_families.py.
SIZED = [name for name, family in FAMILIES.items() if family.geometry is not None]


def rule_grid(name: str, config) -> tuple[int, ...]:
    """The documented default grid of a family, computed here from the model's config by the public size rules."""
    family = FAMILIES[name]
    if family.fixed_grid:  # DiT: the model is made for its sample_size
        return (config.sample_size // config.patch_size,) * len(family.grid_axes)
    # Wan: the family's published default size (frames, height, width) in tokens, with the model's own patch
    return video_token_grid(*family.default_size, patch_size=config.patch_size)


@pytest.mark.parametrize("name", SIZED)
def test_default_config_converts_every_family_and_runs(request, caplog, name):
    transformer = request.getfixturevalue(f"tiny_{name}")
    inputs = request.getfixturevalue(f"{name}_batch")
    grid = rule_grid(name, transformer.config)
    with caplog.at_level(logging.INFO, logger="mhla_diffusion.models.conversion"):
        conversion = convert_to_mhla(transformer, MHLAConfig())
    assert conversion.family == name and conversion.layers == list(range(len(self_attention_layers(transformer))))
    assert conversion.grid == grid == FAMILIES[name].default_grid(transformer.config)
    assert conversion.layout == auto_layout(grid)
    assert conversion.config.target_grid is None  # the config stays as given; the conversion records the grid
    shown = f"block layout {'x'.join(map(str, conversion.layout))}"
    assert shown in caplog.text and "x".join(map(str, grid)) in caplog.text and conversion.grid_origin in caplog.text
    assert shown in conversion.summary() and conversion.grid_origin in conversion.summary()
    out = run(transformer, inputs)
    assert out.shape[0] == inputs["hidden_states"].shape[0] and torch.isfinite(out).all()


def test_wan_default_grid_follows_the_models_patch_size():
    """A Wan transformer of another patch size gets the default video's grid in its own tokens."""
    transformer = tiny_wan_transformer(num_layers=1, patch_size=(1, 4, 4))
    grid = rule_grid("wan", transformer.config)
    assert grid != rule_grid("wan", tiny_wan_transformer(num_layers=1).config)
    conversion = convert_to_mhla(transformer, MHLAConfig())
    assert conversion.grid == grid and conversion.layout == auto_layout(grid)
    assert torch.isfinite(run(transformer, wan_inputs(3, 4, 5))).all()


def test_default_layout_with_equal_blocks_divides_the_default_grid(request):
    """``scalar_mixed_denominator`` picks among layouts that divide the default grid, for every family."""
    for name in SIZED:
        transformer = request.getfixturevalue(f"tiny_{name}")
        grid = rule_grid(name, transformer.config)
        conversion = convert_to_mhla(transformer, MHLAConfig(normalization="scalar_mixed_denominator"))
        assert conversion.layout == auto_layout(grid, equal_blocks=True)
        assert all(g % b == 0 for g, b in zip(grid, conversion.layout))


@pytest.mark.parametrize("name", SIZED)
def test_mhla_convert_chooses_the_same_default_layout(tmp_path, capsys, request, name):
    """``mhla convert`` with no layout, size or grid uses the same rule as ``convert_to_mhla``."""
    out = tmp_path / "mhla"
    assert main(["convert", "--tiny", name, "--no-check", "--output", str(out)]) == 0
    saved = json.loads((out / "mhla_config.json").read_text())["mhla_config"]
    transformer = request.getfixturevalue(f"tiny_{name}")
    assert tuple(saved["layout"]) == auto_layout(rule_grid(name, transformer.config))
    assert f"block layout {'x'.join(map(str, saved['layout']))}" in capsys.readouterr().out
