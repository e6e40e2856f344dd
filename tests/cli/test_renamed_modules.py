"""Old module paths (``mhla_diffusion.demo``, ``mhla_diffusion.webdemo``) still import, warn, and give the new modules."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("old, new", [
    ("mhla_diffusion.demo", "mhla_diffusion.embedded"),
    ("mhla_diffusion.demo.locations", "mhla_diffusion.embedded.locations"),
    ("mhla_diffusion.webdemo.validation", "mhla_diffusion.web.validation"),
])
def test_old_module_path_is_the_new_module_with_a_warning(old, new):
    code = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        "assert old is new, (old, new)\n"
        f"assert {old!r} not in [m.__name__ for m in sys.modules.values() if hasattr(m, '__name__')]\n"
        "print([str(w.message) for w in caught if issubclass(w.category, FutureWarning)])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "is deprecated" in result.stdout and new in result.stdout


def test_unrelated_names_are_not_captured():
    with pytest.raises(ModuleNotFoundError):
        __import__("mhla_diffusion.demonstration")
