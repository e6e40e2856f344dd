"""Where the FID Inception-v3 weights file comes from: an argument or ``$MHLA_INCEPTION_WEIGHTS``, never a
download. Torch-free, so the command line can name the file and the variable in its help.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = [
    "INCEPTION_WEIGHTS_ENV",
    "INCEPTION_WEIGHTS_NAMES",
    "INCEPTION_WEIGHTS_URL",
    "PUBLISHED_SHA256_PREFIX",
    "how_to_get_weights",
    "resolve_inception_weights",
    "sha256_of_file",
]

INCEPTION_WEIGHTS_ENV = "MHLA_INCEPTION_WEIGHTS"
#: torch-fidelity's file (first) and pytorch-fid's file of the same converted TF weights.
INCEPTION_WEIGHTS_NAMES = ("weights-inception-2015-12-05-6726825d.pth", "pt_inception-2015-12-05-6726825d.pth")
#: Where torch-fidelity publishes the file. Named in error messages only; nothing here downloads.
INCEPTION_WEIGHTS_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
)
#: torch.hub names files by the first 8 hex digits of their SHA-256; not yet confirmed on the real
#: file, so a different prefix is a warning, not an error.
PUBLISHED_SHA256_PREFIX = "6726825d"


def how_to_get_weights() -> str:
    """Where to get the file and how to hand it over (for error messages)."""
    return (
        f"download {INCEPTION_WEIGHTS_NAMES[0]} (about 95 MB) from {INCEPTION_WEIGHTS_URL} on a machine with "
        f"internet (pytorch-fid's {INCEPTION_WEIGHTS_NAMES[1]} also works), copy it anywhere on this machine and "
        f"pass --inception-weights PATH or set {INCEPTION_WEIGHTS_ENV}=PATH"
    )


def resolve_inception_weights(path: str | os.PathLike | None = None) -> Path:
    """The weights file: ``path`` if given, else ``$MHLA_INCEPTION_WEIGHTS``; an existing file or an error."""
    source = "the given path"
    if path is None or str(path) == "":
        path = os.environ.get(INCEPTION_WEIGHTS_ENV) or None
        source = f"${INCEPTION_WEIGHTS_ENV}"
    if path is None:
        raise FileNotFoundError(
            f"no Inception weights file was given. FID/sFID/IS/precision-recall need the FID "
            f"Inception-v3 weights: {how_to_get_weights()}"
        )
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise FileNotFoundError(
            f"Inception weights file {resolved} (from {source}) does not exist or is not a file: {how_to_get_weights()}"
        )
    return resolved


def sha256_of_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
