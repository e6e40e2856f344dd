"""The ``slow`` marker: registered in pyproject.toml, never deselected by default (plain ``pytest`` runs
everything), and on every test that starts a process, so ``pytest -m 'not slow'`` starts none."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

TESTS = Path(__file__).parent
#: What starts a process: the subprocess module, the interpreter's path, the project's process launchers,
#: and the fixtures that start a server or a process group.
STARTS_PROCESSES = {"subprocess", "Popen", "executable", "run_fresh", "run_cpu_processes"}
PROCESS_FIXTURES = {"demo_server", "embedded_server", "client", "embedded_client", "parallel_results"}


def _is_slow_mark(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node) == "pytest.mark.slow"


def _names(node: ast.AST) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))
    }


def _unmarked_process_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    marks = [n.value for n in tree.body if isinstance(n, ast.Assign) and "pytestmark" in _names(n.targets[0])]
    if any("slow" in _names(mark) for mark in marks):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def reach(name: str, seen: set[str]) -> set[str]:  # the names a function uses, through this module's helpers
        seen.add(name)
        used = _names(functions[name])
        return used.union(*(reach(n, seen) for n in used & functions.keys() - seen))

    unmarked = []
    for name, fn in functions.items():
        if not name.startswith("test_") or any(_is_slow_mark(d) for d in fn.decorator_list):
            continue
        if reach(name, set()) & STARTS_PROCESSES or {a.arg for a in fn.args.args} & PROCESS_FIXTURES:
            unmarked.append(f"{path.relative_to(TESTS)}::{name}")
    return unmarked


def test_slow_is_registered_and_runs_by_default():
    options = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("slow:") for marker in options["markers"])
    assert "slow" not in options["addopts"]


def test_every_test_that_starts_a_process_is_marked_slow():
    unmarked = [
        test
        for path in sorted(TESTS.rglob("test_*.py"))
        if path != Path(__file__)
        for test in _unmarked_process_tests(path)
    ]
    assert unmarked == []
