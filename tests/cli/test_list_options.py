"""One list rule for every list option (issue 44): commas, YAML brackets, and for numbers ``x`` too."""

from __future__ import annotations

import argparse

import pytest

from mhla_diffusion.cli.arguments import parse_layers, parse_layout, parse_names, parse_sizes


@pytest.mark.parametrize("text", ["3x5x10", "3,5,10", "3, 5, 10", "[3, 5, 10]"])
def test_sizes_take_every_list_spelling(text):
    assert parse_sizes(text) == (3, 5, 10)
    assert parse_layout(text) == (3, 5, 10)


def test_layers_layouts_and_names_take_the_same_rule():
    assert parse_layers("1,2,4") == parse_layers("[1, 2, 4]") == parse_layers("1, 2, 4") == [1, 2, 4]
    assert parse_layers("hybrid") == "hybrid" and parse_layout("auto") == "auto"
    metrics = parse_names(("fvd", "clip", "judge"))
    assert metrics("clip,judge") == metrics("[clip, judge]") == metrics("clip, judge, clip") == ("clip", "judge")


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (parse_sizes, "3xfive", "expected a list of integers such as 3,5,10 (or 3x5x10), got '3xfive'"),
        (parse_sizes, "3x0", "sizes must be positive"),
        (parse_layers, "some", "expected 'all' or 'hybrid' or a list of integers"),
        (parse_names(("fvd", "clip")), "fvd,is", "choose from fvd, clip (comma-separated)"),
    ],
)
def test_a_bad_list_names_what_the_option_takes(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(text)


def test_settings_lists_take_the_same_rule():
    """`mhla build-embedded --set video_student_layout=1x4x4` reads like the trainers' `--mhla.layout 1x4x4`."""
    from mhla_diffusion.embedded.builds.build_settings import BuildSettings
    from mhla_diffusion.utils.options import settings_with

    for text in ("1x4x4", "1,4,4", "[1, 4, 4]"):
        assert settings_with(BuildSettings(), [f"video_student_layout={text}"]).video_student_layout == [1, 4, 4]


@pytest.mark.slow  # starts a fresh interpreter
@pytest.mark.parametrize(
    "command, item, message",
    [
        ("reproduce", "part_a_seeds=x", "`part_a_seeds` must be a list of integers such as 3,5,10"),
        ("reproduce", "part_a_seed=1", "unknown setting `part_a_seed` (did you mean `part_a_seeds`?)"),
        ("build-embedded", "video_student_layout=1,a", "`video_student_layout` must be a list of integers"),
    ],
)
def test_set_errors_come_before_torch(command, item, message):
    """`--set` is read by the same rule before the command imports its module and torch (it took ~20 s)."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\nfrom mhla_diffusion.cli import main\n"
        f"code = main([{command!r}, '--set', {item!r}])\n"
        "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert json.loads(result.stdout.splitlines()[-1]) == {"code": 2, "torch": False}, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_benchmark_frames_take_the_list_rule(capsys):
    """`python -m mhla_diffusion.benchmarks.context_parallel --frames` took space-separated values (nargs)."""
    from mhla_diffusion.benchmarks.context_parallel import main as context_parallel

    for frames, message in [("17,49", "--processes must be >= 2"), ("17,4x", "argument --frames: expected a list")]:
        with pytest.raises(SystemExit):  # both stop while parsing, before any process starts
            context_parallel(["--frames", frames, "--processes", "1"])
        assert message in capsys.readouterr().err
