"""The `mhla` command."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from helpers.models import run, wan_inputs
from mhla_diffusion import get_mhla_conversion, load_mhla
from mhla_diffusion.cli import main
from mhla_diffusion.models.tiny import tiny_wan_transformer


def test_convert_tiny_wan_prints_changes_and_saves(tmp_path, capsys):
    out = tmp_path / "mhla"
    assert (
        main(["convert", "--tiny", "wan", "--layers", "hybrid", "--target-size", "17x64x80", "--output", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "MHLA on 1 of 2 self-attention layers (wan): blocks.1.attn1" in text
    assert "WanAttnProcessor" in text and "WanMHLAProcessor" in text
    assert "output change on a random" in text and "wall time" in text
    model = load_mhla(out, tiny_wan_transformer())
    conversion = get_mhla_conversion(model)
    assert conversion.layers == [1] and conversion.config.target_grid == (5, 4, 5)
    assert torch.isfinite(run(model, wan_inputs())).all()


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "mhla"
    assert main(["convert", "--tiny", "dit", "--output", str(out), "--no-check"]) == 0
    before = (out / "mhla_weights.safetensors").read_bytes()
    assert main(["convert", "--tiny", "dit", "--lepe", "--output", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "mhla_weights.safetensors").read_bytes() == before
    assert main(["convert", "--tiny", "dit", "--lepe", "--output", str(out), "--overwrite", "--no-check"]) == 0
    assert (out / "mhla_weights.safetensors").read_bytes() != before


def test_convert_bad_input_is_a_readable_error(capsys):
    assert main(["convert", "--tiny", "dit", "--layout", "2x2x2"]) == 2
    assert "`layout` (2, 2, 2) must have 2 axes" in capsys.readouterr().err
    assert main(["convert", "--tiny", "wan", "--target-size", "80x480x832"]) == 2
    assert "--target-size 80x480x832: 80 frames is not supported: use 4k+1" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_is_installed():
    exe = shutil.which("mhla")
    assert exe is not None, "install the package (pip install -e .) to get the `mhla` command"
    result = subprocess.run([exe, "convert", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--target-size" in result.stdout


@pytest.mark.parametrize(
    "argv, old, new",
    [
        (["demo-models", "--smoke"], "demo-models", "build-embedded"),
        (["demo", "--port", "7000"], "demo", "web"),
        (["text-to-video", "--attention", "sdpa"], "sdpa", "softmax"),
    ],
)
def test_removed_spellings_are_one_line_errors_naming_the_new_one(capsys, argv, old, new):
    """The names kept for one release (`mhla demo-models`, `mhla demo`, `--attention sdpa`) are gone: refused
    while parsing, on one line that lists the new name among the choices."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"invalid choice: '{old}'" in err and f"'{new}'" in err
