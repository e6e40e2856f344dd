"""Old module paths that still import for one release, with a deprecation warning.

``mhla_diffusion.demo`` is now :mod:`mhla_diffusion.embedded` and ``mhla_diffusion.webdemo`` is
:mod:`mhla_diffusion.web`. Importing an old path (or any module under it) returns the new module
object itself, so there is one copy of each module and ``isinstance`` checks keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["RENAMED_MODULES", "install"]

RENAMED_MODULES = {"mhla_diffusion.demo": "mhla_diffusion.embedded", "mhla_diffusion.webdemo": "mhla_diffusion.web"}


def _new_name(fullname: str) -> str | None:
    for old, new in RENAMED_MODULES.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _RenamedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if _new_name(fullname) else None

    def create_module(self, spec) -> ModuleType:
        return ModuleType(spec.name)  # a placeholder; exec_module swaps in the real module

    def exec_module(self, module: ModuleType) -> None:
        new = _new_name(module.__name__)
        warnings.warn(f"`{module.__name__}` is deprecated and will be removed in the next release; import `{new}`",
                      FutureWarning, stacklevel=2)
        # The import system returns whatever sys.modules holds for the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Add the finder once (idempotent)."""
    if not any(isinstance(finder, _RenamedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RenamedModuleFinder())  # before the path finder, which would load a second copy
