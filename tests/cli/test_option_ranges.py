"""Every number option states its valid range and is checked against it at parse time (issue 46, kind 4).

The options are read from the one option layer: the ``mhla`` commands' and the web demo's ``argparse`` actions
(their types are :func:`~mhla_diffusion.utils.options.number`, carrying ``kind`` and ``valid``), the trainers'
dataclass fields (:func:`~mhla_diffusion.utils.options.field_range`) and their ``--mhla.KEY`` options
(``MHLA_RANGES``). For each: the help states the range, a
value just outside it is refused with a line naming the option, the bound itself (or a value just inside an open
bound) is accepted. Where 0 switches something off, the help says what 0 means and a run logs it once at start.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

import pytest

from mhla_diffusion.cli import build_parser, main
from mhla_diffusion.config import MHLAConfig
from mhla_diffusion.finetune.options import MHLA_RANGES, DiTTrainOptions, WanTrainOptions, load_options
from mhla_diffusion.utils.options import Range, check_ranges, field_help, field_range
from mhla_diffusion.web.app import build_parser as web_parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in sub.choices.values():
        command.format_help()  # a command adds its arguments when first used
    return dict(sub.choices)


def _outside(valid: Range, kind: type) -> list[float]:
    """Values just outside ``valid`` (and ``nan`` for a float)."""
    step = 1 if kind is int else 0.5
    values: list[float] = [float("nan")] if kind is float else []
    if valid.low is not None:
        values.append(valid.low if valid.low_open else valid.low - step)
    if valid.high is not None:
        values.append(valid.high if valid.high_open else valid.high + step)
    return values


def _inside(valid: Range, kind: type) -> list[float]:
    """The bounds a value may take (just inside an open one)."""
    step = 1 if kind is int else 0.25 * min(1, (valid.high - valid.low) if None not in (valid.low, valid.high) else 1)
    values = []
    if valid.low is not None:
        values.append(valid.low + step if valid.low_open else valid.low)
    if valid.high is not None:
        values.append(valid.high - step if valid.high_open else valid.high)
    return values or [0]


def _text(value: float, kind: type) -> str:
    return str(int(value)) if kind is int and value == value else repr(float(value))


def _number_actions() -> list[tuple[str, argparse.Action]]:
    parsers = {f"mhla {name}": p for name, p in _subcommands().items()} | {"app.py": web_parser()}
    found = []
    for where, parser in parsers.items():
        for action in parser._actions:
            if action.type in (int, float) or getattr(action.type, "__name__", "") in ("int", "float"):
                found.append((f"{where} {action.option_strings[0]}", action))
    return found


NUMBER_ACTIONS = _number_actions()


def test_every_command_line_number_option_is_listed():
    # the sweep's examples and one option of each kind of command are among them
    names = {name for name, _ in NUMBER_ACTIONS}
    for name in ("app.py --max-frames", "mhla web --max-frames", "mhla bench --repeats", "mhla eval --batch-size"):
        assert name in names
    assert len(NUMBER_ACTIONS) > 60


@pytest.mark.parametrize("name, action", NUMBER_ACTIONS, ids=[n for n, _ in NUMBER_ACTIONS])
def test_command_line_number_options_check_their_stated_range(name, action):
    valid, kind = getattr(action.type, "valid", None), getattr(action.type, "kind", None)
    assert isinstance(valid, Range), f"{name} reads a number with no stated range: use utils.options.number"
    assert valid.describe() in action.help, f"{name}'s help does not state its range {valid.describe()!r}"
    for value in _outside(valid, kind):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(valid.bounds())):
            action.type(_text(value, kind))
    for value in _inside(valid, kind):
        assert action.type(_text(value, kind)) == pytest.approx(value)


def _number_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)

    def numeric(hint) -> bool:
        if hint in (int, float):
            return True
        return any(numeric(arg) for arg in typing.get_args(hint))

    return [f.name for f in dataclasses.fields(cls) if numeric(hints[f.name])]


TRAINER_FIELDS = [(cls, name) for cls in (WanTrainOptions, DiTTrainOptions) for name in _number_fields(cls)]


def _trainer_text(cls: type, name: str, value: float) -> str:
    hint = typing.get_type_hints(cls)[name]
    kind = int if int in (hint, *typing.get_args(hint)) or "int" in str(hint) else float
    text = _text(value, kind)
    if "list[list" in str(hint):
        return f"{text}x32"  # a size: the other side valid
    return text


@pytest.mark.parametrize("cls, name", TRAINER_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in TRAINER_FIELDS])
def test_trainer_number_options_check_their_stated_range(tmp_path, cls, name):
    valid = field_range(cls, name)
    assert isinstance(valid, Range), f"{cls.__name__}.{name} states no valid range (option(..., valid=...))"
    parser_help = _trainer_help(cls)
    assert valid.describe() in parser_help[name], f"--{name}'s help does not state {valid.describe()!r}"
    base = ["--pretrained_model", "owner/model", "--output_dir", str(tmp_path / "run"), "--data_dir", str(tmp_path)]
    hint = typing.get_type_hints(cls)[name]
    kind = int if "int" in str(hint) else float
    for value in _outside(valid, kind):
        if value != value:  # nan: the finite check comes first, its own message
            continue
        with pytest.raises(ValueError, match=rf"`{name}` must be"):
            load_options(cls, [*base, f"--{name}", _trainer_text(cls, name, value)])
    defaults = cls()
    for value in _inside(valid, kind):
        number = int(value) if kind is int else value
        current = getattr(defaults, name)
        setattr(defaults, name, [number] if isinstance(current, list) or "list[int]" in str(hint) else number)
        if "list[list" in str(hint):
            setattr(defaults, name, [[number, 32]])
        check_ranges(defaults)  # the bound itself is in range


def _trainer_help(cls: type) -> dict[str, str]:
    from mhla_diffusion.finetune.options import _trainer_parser

    return {a.dest: a.help for a in _trainer_parser(cls)._actions}


MHLA_FIELDS = _number_fields(MHLAConfig)


@pytest.mark.parametrize("name", MHLA_FIELDS)
def test_trainer_mhla_number_options_check_their_stated_range(tmp_path, name):
    valid = MHLA_RANGES.get(name)
    assert isinstance(valid, Range), f"--mhla.{name} states no valid range (finetune/options.py MHLA_RANGES)"
    assert valid.describe() in _trainer_help(WanTrainOptions)[f"mhla.{name}"]
    base = ["--pretrained_model", "owner/model", "--output_dir", str(tmp_path / "run"), "--data_dir", str(tmp_path)]
    kind = int if "int" in str(typing.get_type_hints(MHLAConfig)[name]) else float
    for value in _outside(valid, kind):
        if value != value:
            continue
        with pytest.raises(ValueError, match=rf"`mhla.{name}` must be"):
            load_options(WanTrainOptions, [*base, f"--mhla.{name}", _text(value, kind)])
    for value in _inside(valid, kind):
        assert (int(value) if kind is int else value) in valid


def test_zero_that_turns_something_off_is_in_the_help():
    for cls, name in TRAINER_FIELDS:
        valid = field_range(cls, name)
        if valid.zero:
            assert f"0: {valid.zero}" in _trainer_help(cls)[name]
    assert "0: never" in _trainer_help(WanTrainOptions)["checkpointing_steps"]
    assert "every N optimizer steps" in field_help(WanTrainOptions, "checkpointing_steps")


# ---------------------------------------------------------------- the sweep's examples, end to end


def test_web_max_frames_zero_is_refused_before_serving(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["web", "--max-frames", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--max-frames: expected an integer >= 1, got '0'" in err


def test_web_environment_values_keep_the_range(monkeypatch):
    monkeypatch.setenv("MHLA_DEMO_MAX_FRAMES", "0")
    with pytest.raises(ValueError, match="MHLA_DEMO_MAX_FRAMES: expected an integer >= 1, got '0'"):
        web_parser()


def test_a_command_says_once_what_a_zero_turns_off(tmp_path, capsys):
    argv = ["eval-ref", "--images", str(tmp_path / "none"), "--output", str(tmp_path / "r.npz"), "--pr-images", "0"]
    assert main(argv) == 2  # the folder is missing: the note comes first, then the error
    err = capsys.readouterr().err
    assert err.count("off (set to 0)") == 1
    assert "mhla eval-ref: off (set to 0): --pr-images 0: statistics only, no arr_0" in err
