"""Lazy re-exports for package ``__init__`` files (PEP 562).

A package lists ``name -> submodule`` and imports the submodule on first attribute access, so
``import mhla_diffusion`` (and the ``mhla`` command's start-up) does not pull in torch or Diffusers
until something that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` that import ``exports[name]`` (relative to it) on demand."""

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
