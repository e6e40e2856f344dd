"""The README's test command works on a fresh clone after its first command (``pip install -e .``): it installs
what the tests import that the project's own dependencies do not bring."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def _test_command() -> str:
    readme = (REPO / "README.md").read_text()
    return re.search(r"Run the tests:\n\n```bash\n(.+)\n```", readme).group(1)


def _closure(name: str, extra: str) -> set[str]:
    """The distributions ``pip install name[extra]`` installs: its requirements with ``extra`` and everything they
    require in turn (read from the installed metadata)."""
    seen: set[str] = set()
    todo = [(Requirement(name), extra)]
    while todo:
        requirement, wanted = todo.pop()
        key = canonicalize_name(requirement.name)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [
            (r, "")
            for r in map(Requirement, requires)
            if r.marker is None or r.marker.evaluate({"extra": wanted}) or r.marker.evaluate({"extra": ""})
        ]
    return seen


def _imported_by_tests() -> set[str]:
    """Top-level modules the test files import, at module level or inside functions."""
    found: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"helpers", "conftest", "mhla_diffusion"}


def test_readme_test_command_installs_the_test_extras_first():
    command = _test_command()
    assert command.startswith('pip install -e ".[test]" && '), command
    assert command.endswith('python -m pytest -q -m "not slow"')


def test_the_test_extras_bring_what_the_tests_import():
    installed = _closure("mhla-diffusion", "test")  # what `pip install -e ".[test]"` installed
    distributions = metadata.packages_distributions()
    missing = sorted(
        module
        for module in _imported_by_tests()
        if not any(canonicalize_name(d) in installed for d in distributions.get(module, [module]))
    )
    assert not missing, f"tests import {missing}, which neither `pip install -e .` nor the test extras install"
