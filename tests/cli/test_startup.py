"""The ``mhla`` command parses before it imports: help and argument errors never load torch or Diffusers.

Each case runs in a fresh interpreter and lists the modules it ended up with; one test also bounds the time
of every entry point's ``--help`` (generously: each takes well under 1 s on an idle machine).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: Every test here starts processes or trains (``pytest -m 'not slow'`` skips them).
pytestmark = pytest.mark.slow

HEAVY = ("torch", "diffusers", "transformers")

#: (entry point, arguments, expected exit code). Every command's help builds that command's arguments.
CASES = [
    ("mhla_diffusion.cli", ["--help"], 0),
    ("mhla_diffusion.cli", ["text-to-video", "--help"], 0),
    ("mhla_diffusion.cli", ["text-to-video", "--attention", "nonsense"], 2),
    ("mhla_diffusion.cli", ["image-to-video", "--prompt", "x"], 2),  # --image and --model are required
    ("mhla_diffusion.cli", ["convert", "--layout", "3xfive"], 2),
    ("mhla_diffusion.cli", ["no-such-command"], 2),
    *[
        ("mhla_diffusion.cli", [command, "--help"], 0)
        for command in (
            "convert",
            "class-to-image",
            "image-to-video",
            "import-wan",
            "import-dit",
            "eval",
            "eval-ref",
            "eval-sample",
            "eval-video",
            "bench",
            "build-embedded",
        )
    ],
    ("mhla_diffusion.cli", ["web", "--help"], 0),
    ("mhla_diffusion.eval.__main__", ["--help"], 0),
    ("mhla_diffusion.eval.__main__", ["eval-sample", "--help"], 0),
]

SCRIPT = """
import json, sys
from {module} import main
try:
    code = main({argv!r})
except SystemExit as exit:
    code = exit.code
print("\\nMODULES " + json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
"""


def imported_by(module: str, argv: list[str]) -> tuple[int, list[str], str]:
    """Exit code, modules loaded, and stderr of ``module.main(argv)`` in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(module=module, argv=argv)], capture_output=True, text=True, timeout=120
    )
    assert "MODULES " in result.stdout, result.stderr[-2000:]
    report = json.loads(result.stdout.rsplit("MODULES ", 1)[1])
    return report["code"], report["modules"], result.stderr


def _case_id(case) -> str:
    module, argv, _ = case.values if hasattr(case, "values") else case
    return " ".join([module.split(".")[1], *argv])


@pytest.mark.parametrize("module,argv,code", CASES, ids=[_case_id(c) for c in CASES])
def test_help_and_argument_errors_import_no_heavy_library(module, argv, code):
    exit_code, modules, stderr = imported_by(module, argv)
    assert exit_code == code, stderr
    heavy = sorted(name for name in modules if name.split(".")[0] in HEAVY)
    assert not heavy, f"{module} {' '.join(argv)} imported {heavy[:5]}"


REPO = Path(__file__).resolve().parents[2]

#: The bound of one ``--help`` (each takes 0.2-0.8 s on an idle 2-core machine; the trainers' took 11-16 s
#: when their help imported torch). Generous, so a busy CI machine does not fail it.
HELP_SECONDS = 5.0


def _help_commands() -> list[list[str]]:
    from mhla_diffusion.cli import build_parser

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    return [
        ["-m", "mhla_diffusion.cli", "--help"],
        *(["-m", "mhla_diffusion.cli", name, "--help"] for name in subcommands),
        ["finetune/train_wan.py", "--help"],
        ["finetune/train_dit.py", "--help"],
        ["app.py", "--help"],
    ]


@pytest.mark.parametrize("command", _help_commands(), ids=lambda c: " ".join(c[2:] if c[0] == "-m" else c))
def test_every_entry_points_help_is_fast_and_imports_no_heavy_library(command):
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *command], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    seconds = time.perf_counter() - start
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY)
    assert not heavy, f"{' '.join(command)} imported {heavy[:5]}"
    assert seconds < HELP_SECONDS, f"{' '.join(command)} took {seconds:.1f} s"
