"""Where a model named on the command line, in the web config or to ``from_pretrained`` lives: a local
path or a hub repo id. The one rule both the loaders (:mod:`mhla_diffusion.loaders.loading`) and the
weight-folder reader (:mod:`mhla_diffusion.loaders.weight_files`) decide with.

A name is a hub id only when it has the hub's form ``owner/name`` and is nothing on disk; anything
that exists, is absolute, starts with ``.`` or ``~``, or has no or several ``/`` is a local path.
"""

from __future__ import annotations

import os
from typing import Literal

__all__ = ["SourceKind", "source_kind"]

#: ``folder``: an existing local folder; ``file``: an existing local non-folder; ``missing``: a local
#: path with nothing there; ``hub``: a hub repo id.
SourceKind = Literal["folder", "file", "missing", "hub"]


def source_kind(source: str | os.PathLike) -> SourceKind:
    """What ``source`` names: an existing ``folder`` or ``file``, a ``missing`` local path, or a ``hub`` id."""
    text = os.fspath(source)
    if os.path.isdir(text):
        return "folder"
    if os.path.exists(text):
        return "file"
    if os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") != 1:
        return "missing"
    return "hub"
