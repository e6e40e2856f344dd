"""The repository layout as a reader meets it: file path = import path, runnable scripts, docs name real paths.

The subprocesses run with ``python -S`` and only the site-packages folders on ``PYTHONPATH``, so the
editable install's import hook (a ``.pth`` file) is not there: the checkout alone must be enough.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_without_install(args: list[str], pythonpath: list[Path]) -> subprocess.CompletedProcess:
    site = [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), *dict.fromkeys(site)])}
    return subprocess.run([sys.executable, "-S", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_packages_import_from_a_checkout_with_pythonpath_dot():
    code = (
        "import mhla_diffusion.finetune, mhla_diffusion.pipelines, mhla_diffusion.eval, mhla_diffusion.web, "
        "mhla_diffusion.embedded, mhla_diffusion.cli\n"
        "import mhla_diffusion.finetune.train_wan, mhla_diffusion.pipelines.wan, mhla_diffusion.eval.evaluate\n"
        "import sys; print('editable-finder' if any('editable' in type(f).__module__ "
        "for f in sys.meta_path) else 'plain')\n"
        "print(mhla_diffusion.finetune.__file__)"
    )
    result = _run_without_install(["-c", code], [REPO])
    assert result.returncode == 0, result.stderr
    mode, path = result.stdout.split()
    assert mode == "plain"
    assert Path(path) == REPO / "mhla_diffusion" / "finetune" / "__init__.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, expected",
    [
        ("finetune/train_wan.py", "--config"),
        ("finetune/train_dit.py", "--config"),
        ("eval/evaluate.py", "--samples"),
        ("eval/make_reference.py", "--images"),
        ("eval/sample.py", "--num-samples"),
        ("pipelines/text_to_video.py", "--prompt"),
        ("pipelines/image_to_video.py", "--image"),
        ("pipelines/class_to_image.py", "--class"),
        ("benchmarks/gpu_session.py", "--smoke"),
    ],
)
def test_entry_scripts_run_from_a_checkout(script, expected):
    result = _run_without_install([script, "--help"], [])  # no PYTHONPATH=.: the script finds the checkout itself
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


# `path` in backticks that starts with one of the repository's own folders or files.
_PATH = re.compile(r"`((?:mhla_diffusion|pipelines|finetune|eval|benchmarks|tests|docs|app\.py|\.ci)(?:/[\w.\-*]+)*/?)")


DOCS = [
    "README.md",
    "finetune/README.md",
    "eval/README.md",
    "pipelines/README.md",
    *sorted(str(page.relative_to(REPO)) for page in (REPO / "docs").glob("*.md")),
]


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_only_paths_that_exist(doc):
    text = (REPO / doc).read_text()
    missing = []
    for match in _PATH.finditer(text):
        path = match.group(1).rstrip("/")
        if "*" in path or "/" not in path and path not in ("app.py",):
            continue  # glob patterns and bare module names
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{doc} names paths that do not exist: {sorted(set(missing))}"
