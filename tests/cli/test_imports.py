"""Every module of ``mhla_diffusion`` imports, no two modules import each other, even through a chain, and the
torch-free rules (``utils/``) import no torch (what ``docs/architecture.md`` states).

The import graph is read from the source with ``ast``: every ``import`` and ``from ... import``,
including those inside functions (a deferred import that closes a cycle is still a cycle). A name
re-exported lazily by a package ``__init__`` (``_EXPORTS``, PEP 562) counts as an import of the
module that defines it, not of the package.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import mhla_diffusion

PACKAGE = Path(mhla_diffusion.__file__).parent
#: Modules not imported by the import check: Gradio's page and the modules it is made of, which must be imported
#: only after ``mhla_diffusion.web.app.prepare_environment`` (see its docstring).
NOT_IMPORTED = {"mhla_diffusion.web.ui", "mhla_diffusion.web.events", "mhla_diffusion.web.long_video"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def lazy_exports(package: str) -> dict[str, str]:
    """``name -> module`` of a package that re-exports lazily (``{}`` for the others)."""
    if MODULES[package].name != "__init__.py" or "_EXPORTS" not in MODULES[package].read_text():
        return {}
    exports = getattr(importlib.import_module(package), "_EXPORTS", {})
    return {name: importlib.util.resolve_name(target, package) for name, target in exports.items()}


def imports_of(module: str) -> set[str]:
    """The ``mhla_diffusion`` modules ``module`` imports anywhere in its source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (
                importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                if node.level
                else node.module
            )
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:  # a submodule
                    found.add(f"{base}.{alias.name}")
                elif base in MODULES and alias.name in lazy_exports(base):
                    found.add(lazy_exports(base)[alias.name])
                else:
                    found.add(base)
    return {name for name in found if name in MODULES and name != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    graph = {module: imports_of(module) for module in MODULES}
    assert graph["mhla_diffusion.cli"] >= {
        "mhla_diffusion.cli.generate",
        "mhla_diffusion.cli.arguments",
    }  # the walk works
    assert "mhla_diffusion.embedded.locations" in imports_of("mhla_diffusion.cli.generate")  # lazy exports resolve
    found = cycles(graph)
    assert not found, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(component) for component in found
    )


@pytest.mark.slow
def test_every_module_imports():
    """One fresh interpreter imports every module (``__main__`` modules too: they run nothing on import)."""
    modules = sorted(set(MODULES) - NOT_IMPORTED)
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_utils_import_no_torch():
    """``docs/architecture.md``: the rules in ``utils/`` need no torch (the CLI checks sizes before loading it)."""
    modules = sorted(name for name in MODULES if name.startswith("mhla_diffusion.utils."))
    script = (
        "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(modules) >= 5 and result.stdout.split("\n")[-2] == "[]", result.stdout


def test_the_embedded_subpackages_and_the_experiment_import_in_one_direction():
    """``docs/architecture.md``: ``embedded/worlds`` imports no other job of ``embedded/``, ``judges`` only the
    worlds, and ``mhla reproduce``'s package nothing of ``embedded/`` (it is not an embedded model)."""
    forbidden = {
        "mhla_diffusion.embedded.worlds": ("mhla_diffusion.embedded.judges", "mhla_diffusion.embedded.builds"),
        "mhla_diffusion.embedded.judges": ("mhla_diffusion.embedded.builds",),
        "mhla_diffusion.reproduce": ("mhla_diffusion.embedded",),
    }
    checked = 0
    for package, targets in forbidden.items():
        for module in (m for m in MODULES if m == package or m.startswith(package + ".")):
            checked += 1
            wrong = sorted(i for i in imports_of(module) if i.startswith(targets))
            assert not wrong, f"{module} imports {wrong}, against the layering in docs/architecture.md"
    assert checked >= 15


def test_no_module_is_over_900_lines():
    """Issue 63: a module a reader can take in (the library, the GPU session's stages, the checkout's scripts)."""
    repo = PACKAGE.parent
    paths = [*PACKAGE.rglob("*.py"), *(repo / "benchmarks").rglob("*.py")]
    paths += [p for folder in ("pipelines", "finetune", "eval") for p in (repo / folder).glob("*.py")]
    long = {str(p.relative_to(repo)): n for p in paths if (n := len(p.read_text().splitlines())) > 900}
    assert not long, f"modules over 900 lines: {long}"


def test_only_the_load_plan_looks_up_a_model_sources_files():
    """Issue 63: a source is resolved once, by ``loaders/plan.py``; no other module fetches a model's files from the
    hub (``hf_hub_download``) or reads a component's config by source (``load_config``), except the hub check that
    runs before anything loads (``loaders/loading.py``'s ``check_hub_model``)."""
    allowed = {"mhla_diffusion.loaders.plan": "hf_hub_download", "mhla_diffusion.loaders.loading": "hf_hub_download"}
    found = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in ("hf_hub_download", "load_config", "find_file") and allowed.get(module) != name:
                    found.setdefault(module, []).append(f"{name} (line {node.lineno})")
    assert not found, f"modules that look up a model source's files outside the load plan: {found}"
