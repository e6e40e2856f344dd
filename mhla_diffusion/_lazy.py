"""Lazy re-exports for package ``__init__`` files (PEP 562).

A package lists ``name -> submodule`` and imports the submodule on first attribute access, so
``import mhla_diffusion`` (and the ``mhla`` command's start-up) does not pull in torch or Diffusers
until something that needs them is used.

A name exported from a submodule of the same name (``mhla_diffusion.eval.evaluate``, the function,
from ``mhla_diffusion.eval.evaluate``, the module) stays the exported object: importing the
submodule would otherwise replace the package attribute with the module, as Python binds every
imported submodule on its package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any, Callable


class _LazyPackage(types.ModuleType):
    """A package module whose exported names win over same-named submodules bound by the import system."""

    def __setattr__(self, name: str, value: Any) -> None:
        exports = self.__dict__.get("_lazy_exports", {})
        if isinstance(value, types.ModuleType) and name in exports and value.__name__ == exports[name]:
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` that import ``exports[name]`` (relative to it) on demand."""
    module = sys.modules[package]
    module._lazy_exports = {  # names exported from the submodule of the same name
        name: importlib.util.resolve_name(target, package)
        for name, target in exports.items()
        if importlib.util.resolve_name(target, package) == f"{package}.{name}"
    }
    module.__class__ = _LazyPackage

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals_of(package)) | set(exports))

    return __getattr__, __dir__


def globals_of(package: str) -> list[str]:
    return list(vars(importlib.import_module(package)))
