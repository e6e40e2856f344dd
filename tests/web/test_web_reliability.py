"""The web demo's answers to odd input: text and non-finite numbers through the API, sizes and defaults the
model cannot take, seeds, and prompt words the tokenizer does not know (the shared ``demo_server``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers.web import FRAMES, SIZE, STEPS

pytest.importorskip("gradio", reason="the web demo needs gradio (pip install -e .[test])")


def _config(*argv: str):
    from mhla_diffusion.web.app import build_parser
    from mhla_diffusion.web.config import config_from_args

    return config_from_args(build_parser().parse_args(list(argv)))


def test_a_default_size_the_model_cannot_take_is_refused_before_loading():
    # the embedded text-to-video model's position table holds 64 tokens per axis of 4 px: 256 px at most
    with pytest.raises(
        ValueError,
        match=r"largest size is 127 frames, 256x256: height 1024 is larger than the "
        r"model supports: at most 256",
    ):
        _config("--height", "1024")
    assert _config("--height", "256").defaults.height == 256


@pytest.mark.parametrize("flag", ["--video-guidance-scale", "--image-guidance-scale"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_form_defaults_are_refused(capsys, flag, value):
    with pytest.raises(SystemExit):  # at parse time: the flag's range (utils.options.number)
        _config(flag, value)
    assert f"argument {flag}: expected a finite number from 0 to 20, got '{value}'" in capsys.readouterr().err


def test_non_finite_numbers_in_a_request_are_refused():
    from mhla_diffusion.web.validation import DemoInputError, video_request

    for guidance in (math.nan, math.inf, "nan", "-inf"):
        with pytest.raises(DemoInputError, match="Guidance scale must be a finite number"):
            video_request("a cat", "", 0, 2, guidance, 5, 32, 32)


def test_one_seed_rule_for_the_cli_and_the_demo():
    from mhla_diffusion.utils import geometry
    from mhla_diffusion.web import validation

    assert validation.MAX_SEED is geometry.MAX_SEED == 2**32 - 1
    with pytest.raises(validation.DemoInputError, match="Seed -5 is out of range: use 0 to 4294967295"):
        validation.video_request("a cat", "", -5, 2, 5.0, 5, 32, 32)
    assert validation.video_request("a cat", "", geometry.MAX_SEED, 2, 5.0, 5, 32, 32).seed == geometry.MAX_SEED


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_refused_before_anything_starts(capsys, monkeypatch, port):
    from mhla_diffusion.cli import main
    from mhla_diffusion.web import app

    monkeypatch.setattr(app, "serve", lambda *a, **k: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as stop:
        main(["web", "--port", port])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"mhla web: error: argument --port: expected an integer from 1 to 65535, got '{port}' "
        "(`mhla web --help` lists the options)\n"
    )


# ---------------------------------------------------------------- through the running server

TEXT_NUMBERS = [
    (2, "abc", "Seed must be a whole number, got 'abc'"),
    (2, "inf", "Seed must be a whole number, got 'inf'"),
    (3, "many", "Steps must be a whole number, got 'many'"),
    (4, "inf", "Guidance scale must be a finite number, got 'inf'"),
    (4, "abc", "Guidance scale must be a number, got 'abc'"),
    (5, "nine", "Frames must be a whole number, got 'nine'"),
    (6, "abc", "Height must be a whole number, got 'abc'"),
]


@pytest.mark.slow
def test_numbers_typed_as_text_get_the_pages_message_and_no_traceback(client, demo_server):
    import json
    import urllib.request

    from gradio_client.exceptions import AppError

    with urllib.request.urlopen(demo_server.url + "/config", timeout=5) as response:
        types = {component["type"] for component in json.load(response)["components"]}
    assert {"number", "slider"} <= types and not any(t.startswith("checked") for t in types), (
        types
    )  # Gradio's own widgets
    import mhla_diffusion.web

    assert not list(Path(mhla_diffusion.web.__file__).parent.glob("*.pyi"))  # Gradio writes stubs for subclasses

    log_before = len(demo_server.log_text())
    base = ["a cat", "", 0, STEPS, 5.0, FRAMES, SIZE, SIZE, False]
    for index, value, expected in TEXT_NUMBERS:
        args = list(base)
        args[index] = value
        with pytest.raises(AppError) as caught:
            client.predict(*args, api_name="/generate_video")
        assert expected in str(caught.value), str(caught.value)
    with pytest.raises(AppError) as caught:
        client.predict("goldfish", "abc", STEPS, 4.0, False, api_name="/generate_image")
    assert "Seed must be a whole number, got 'abc'" in str(caught.value)
    new_log = demo_server.log_text()[log_before:]
    assert "Traceback" not in new_log, new_log
    # numbers as text that are numbers are taken
    mhla, _, summary = client.predict(
        "a cat", "", "3", str(STEPS), "5", str(FRAMES), str(SIZE), str(SIZE), False, api_name="/generate_video"
    )
    assert "seed 3" in summary


@pytest.mark.slow
def test_words_the_tokenizer_does_not_know_are_named_in_the_page(client):
    # the tiny pipeline's word-level tokenizer knows "a", "red", "circle", not "zebra" or an emoji
    _, _, summary = client.predict(
        "a red zebra circle \U0001f993", "", 0, 1, 5.0, FRAMES, SIZE, SIZE, False, api_name="/generate_video"
    )
    assert "does not know 'zebra', '\U0001f993'" in summary and "generated without them" in summary
    _, _, summary = client.predict("a red circle", "", 0, 1, 5.0, FRAMES, SIZE, SIZE, False, api_name="/generate_video")
    assert "does not know" not in summary
