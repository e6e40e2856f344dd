"""The public API and every documented command stay in place (issue 63): every name of
``mhla_diffusion.__all__`` imports, and every command a README or docs page shows in a shell block (``mhla SUB``,
``python SCRIPT.py``, ``accelerate launch SCRIPT.py``) answers ``--help`` (in process: no interpreter start per
command)."""

from __future__ import annotations

import re
import runpy
import sys
import warnings
from pathlib import Path

import pytest

import mhla_diffusion
from mhla_diffusion.cli import main

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md"))]


def _shell_lines(page: Path) -> list[str]:
    """The commands of ``page``'s ``bash`` / ``sh`` blocks, continuation lines joined, comments dropped."""
    lines, block, pending = [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() in ("```bash", "```sh", "```shell") if not block else False
            continue
        if block:
            text = pending + line.split(" #", 1)[0].strip()
            pending = text[:-1] + " " if text.endswith("\\") else ""
            if not pending and text and not text.startswith("#"):
                lines.append(text)
    return lines


def _documented() -> tuple[set[str], set[str]]:
    subcommands, scripts = set(), set()
    for page in PAGES:
        for line in _shell_lines(page):
            words = line.split()
            if words[0] == "mhla" and len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*", words[1]):
                subcommands.add(words[1])
            for word in words:
                if word.endswith(".py") and (REPO / word).is_file() and "/" in word or word == "app.py":
                    scripts.add(word)
    return subcommands, scripts


SUBCOMMANDS, SCRIPTS = _documented()


def test_every_public_name_imports():
    missing = [name for name in mhla_diffusion.__all__ if not hasattr(mhla_diffusion, name)]
    assert not missing and len(mhla_diffusion.__all__) >= 30, missing


def test_the_documented_commands_were_found():
    assert {"generate", "convert", "reproduce", "build-embedded", "bench"} <= SUBCOMMANDS
    assert {"finetune/train_wan.py", "pipelines/text_to_video.py", "app.py"} <= SCRIPTS


@pytest.mark.parametrize("subcommand", sorted(SUBCOMMANDS))
def test_every_documented_subcommand_answers_help(subcommand, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([subcommand, "--help"])
    assert stopped.value.code == 0 and capsys.readouterr().out.startswith(f"usage: mhla {subcommand}")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_documented_script_answers_help(script, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as stopped, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_path(str(REPO / script), run_name="__main__")
    captured = capsys.readouterr()
    assert stopped.value.code in (0, None), f"`{script} --help` failed:\n{captured.err[-2000:]}"
    assert "usage:" in captured.out
