"""Every command a hint names exists and works (issue 57).

A hint is a command in backticks (`...` or ``...``) inside a string literal of the library or of the checkout's
scripts (error messages, help texts, reports, docstrings) that starts with ``mhla``, ``hf``, ``python
finetune/``, ``python app.py``, ``python -m mhla_diffusion`` or ``accelerate launch``. An ``mhla SUB`` hint must
name a subcommand of :func:`mhla_diffusion.cli.build_parser` and only options of that subcommand (checked in
process), and each distinct named command's ``--help`` runs once: ``mhla SUB --help`` in process, the others
(``hf download``, ``python finetune/train_wan.py``, ``accelerate launch``, ...) as processes, whose help must
list every option the hints give them. Placeholders (``FILE``, ``...``, ``<output_dir>``, an f-string's
``{...}``) are fine.

A label that reads like a command, such as the stream benchmark's ``"mhla stream"`` rows, is written as the quoted
value it is (``"mhla stream"`` inside the backticks), so it is not taken for a hint.
"""

from __future__ import annotations

import argparse
import ast
import re
import runpy
import shutil
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

from mhla_diffusion.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
#: The library and the checkout's runnable scripts.
SOURCES = sorted(
    [
        *(REPO / "mhla_diffusion").rglob("*.py"),
        REPO / "app.py",
        *(path for folder in ("finetune", "eval", "pipelines") for path in (REPO / folder).glob("*.py")),
    ]
)
PREFIXES = ("mhla ", "hf ", "python finetune/", "python app.py", "python -m mhla_diffusion", "accelerate launch")
#: ``double`` (reST) or `single` (Markdown) backticks.
_SPAN = re.compile(r"``(.+?)``|(?<!`)`([^`]+)`(?!`)", re.S)
_FLAG = re.compile(r"--?[A-Za-z][\w-]*")
_WORD = re.compile(r"[a-z][a-z0-9-]*")  # a (sub)command's name, not an argument or a placeholder


def _text(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's replacement fields become ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def collect_hints() -> list[tuple[str, str]]:
    """``(where, command)`` of every hint in :data:`SOURCES`, ``where`` as ``path:line``."""
    hints = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        for node in ast.walk(tree):
            text = None if id(node) in parts else _text(node)
            for match in _SPAN.finditer(text or ""):
                command = " ".join((match.group(1) or match.group(2)).split())
                if command.startswith(PREFIXES):
                    hints.append((f"{path.relative_to(REPO)}:{node.lineno}", command))
    return hints


def _flags(words: list[str]) -> list[str]:
    return [word.split("=")[0] for word in words if _FLAG.fullmatch(word.split("=")[0])]


def named_commands(hint: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """The commands ``hint`` names, each with the options the hint gives it: ``mhla SUB`` (or ``mhla`` itself),
    ``hf GROUP [COMMAND]``, ``python SCRIPT``, ``python -m MODULE [COMMAND]``, ``accelerate launch`` and the
    program it launches. ``mhla <command> ...`` names none."""
    words = hint.split()
    if words[0] == "mhla":
        if len(words) == 1 or words[1].startswith("-"):
            return [(("mhla",), _flags(words[1:]))]
        if words[1].startswith(("<", "{")):
            return []
        return [(("mhla", words[1]), _flags(words[2:]))]
    if words[0] == "hf":
        n = 1
        while n < len(words) and _WORD.fullmatch(words[n]):
            n += 1
        return [(tuple(words[:n]), _flags(words[n:]))]
    if words[0] == "python":
        if words[1] == "-m":
            n = 4 if len(words) > 3 and _WORD.fullmatch(words[3]) else 3
            return [(tuple(words[:n]), _flags(words[n:]))]
        return [(tuple(words[:2]), _flags(words[2:]))]
    n = 2  # accelerate launch's own options come first
    while n < len(words) and words[n].startswith("-"):
        n += 1
    launched: list[tuple[tuple[str, ...], list[str]]] = []
    if "-m" in words[2:n] and n < len(words):  # accelerate launch -m MODULE ...
        launched = named_commands(" ".join(["python", "-m", *words[n:]]))
    elif n < len(words) and words[n].endswith(".py"):
        launched = named_commands(" ".join(["python", *words[n:]]))
    return [(("accelerate", "launch"), _flags(words[2:n])), *launched]


HINTS = collect_hints()
#: Each named command -> ``(where, hint, options)`` of the hints that name it.
NAMED: dict[tuple[str, ...], list[tuple[str, str, list[str]]]] = defaultdict(list)
for _where, _hint in HINTS:
    for _command, _options in named_commands(_hint):
        NAMED[_command].append((_where, _hint, _options))
MHLA = sorted(command for command in NAMED if command[0] == "mhla")
#: ``python -m mhla_diffusion...``: run in this process (their imports are this process's already).
MODULES = sorted(command for command in NAMED if command[:2] == ("python", "-m") and command[2].startswith("mhla_"))
OTHERS = sorted(command for command in NAMED if command[0] != "mhla" and command not in MODULES)


def _ids(command: tuple[str, ...]) -> str:
    return " ".join(command)


def test_hints_are_collected_and_labels_are_not():
    assert {("mhla", "build-embedded"), ("mhla", "text-to-video"), ("hf", "download")} <= NAMED.keys()
    assert ("mhla", "stream") not in NAMED  # the benchmark's "mhla stream" rows: a label, written quoted
    stream_hints = [hint for _, hint, options in NAMED["mhla", "build-embedded"] if "--stream" in options]
    assert stream_hints, "the long-video models' hint (`mhla build-embedded --stream`) was not found"


@pytest.mark.parametrize("command", MHLA, ids=_ids)
def test_mhla_hint_names_a_command_and_its_options(command, capsys):
    parser = build_parser()
    if len(command) > 1:
        choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        names = [where for where, _, _ in NAMED[command]]
        assert command[1] in choices, f"`{_ids(command)}` is no mhla command ({', '.join(names)})"
        parser = choices[command[1]]
        parser.format_help()  # a subcommand adds its options when first used
    unknown = [
        f"{where}: `{hint}`: {option}"
        for where, hint, options in NAMED[command]
        for option in options
        if option not in parser._option_string_actions
    ]
    assert not unknown, f"options `{_ids(command)}` does not have:\n" + "\n".join(unknown)
    with pytest.raises(SystemExit) as stopped:
        main([*command[1:], "--help"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {_ids(command)}")


def _argv(command: tuple[str, ...]) -> list[str]:
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    exe = shutil.which(command[0])
    assert exe is not None, f"`{command[0]}` is not installed (hints name it: {NAMED[command][0][0]})"
    return [exe, *command[1:]]


@pytest.mark.parametrize("command", MODULES, ids=_ids)
def test_module_hint_commands_run_and_have_the_options(command, capsys, monkeypatch):
    module, *arguments = command[2:]
    monkeypatch.setattr(sys, "argv", [module, *arguments, "--help"])
    with pytest.raises(SystemExit) as stopped, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    captured = capsys.readouterr()
    assert stopped.value.code in (0, None), f"`{_ids(command)} --help` failed:\n{captured.err[-2000:]}"
    _check_options(command, captured.out + captured.err)


@pytest.mark.slow
@pytest.mark.parametrize("command", OTHERS, ids=_ids)
def test_other_hint_commands_run_and_have_the_options(command):
    result = subprocess.run([*_argv(command), "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    where = ", ".join(where for where, _, _ in NAMED[command])
    assert result.returncode == 0, f"`{_ids(command)} --help` failed ({where}):\n{result.stderr[-2000:]}"
    _check_options(command, result.stdout + result.stderr)


def _check_options(command: tuple[str, ...], text: str) -> None:
    """Every option the hints give ``command`` appears in its help ``text``."""
    unknown = [
        f"{where}: `{hint}`: {option}"
        for where, hint, options in NAMED[command]
        for option in options
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text)
    ]
    assert not unknown, f"`{_ids(command)} --help` lists none of:\n" + "\n".join(unknown)
