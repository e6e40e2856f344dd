"""Small points a newcomer tripped on (issue 44, item 8): `mhla --version`, `mhla web` without Gradio, the
`--transformer` help of class-to-image. (The trainers' usage line and warmup warning are in
tests/finetune/test_finetune_options.py, eval-video's Inception Score in tests/eval/test_eval_video.py,
`reproduce --budget` in tests/reproduce/test_experiment.py.)"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

import mhla_diffusion
from mhla_diffusion.cli import main


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"mhla-diffusion {mhla_diffusion.__version__}"
    assert importlib.metadata.version("mhla-diffusion") == mhla_diffusion.__version__  # one version, in __init__


@pytest.mark.parametrize("entry", ["mhla web", "python app.py"])
def test_web_without_gradio_says_how_to_install_it_before_starting(entry, monkeypatch, capsys):
    """It printed "server closed, temporary outputs deleted" and then a ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` fails, as where it is not installed
    if entry == "mhla web":
        code = main(["web"])
    else:
        from mhla_diffusion.web.app import main as app_main

        code = app_main([])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and 'needs Gradio, which is not installed: pip install -e ".[demo]"' in (
        captured.err
    )
    assert captured.out == ""  # nothing started: no outputs folder, no "server closed"


def test_class_to_image_transformer_help_and_a_file_speak_of_dit(capsys, tmp_path):
    def transformer_help(command: str) -> str:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        return text[text.index("--transformer TRANSFORMER ") :].split(" --attention")[0]

    dit = transformer_help("class-to-image")
    assert "DiT" in dit and "mhla import-dit" in dit and "Wan" not in dit
    assert "Wan checkpoint file" in transformer_help("text-to-video")
    checkpoint = tmp_path / "DiT-XL-2-256x256.pt"
    checkpoint.write_bytes(b"not read")
    assert main(["class-to-image", "--transformer", str(checkpoint), "--class", "1"]) == 2
    assert "class-to-image takes a transformer folder" in capsys.readouterr().err
