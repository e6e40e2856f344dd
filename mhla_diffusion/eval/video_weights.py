"""Where the video metrics' networks come from: the FVD I3D file and a local CLIP folder, never a download.

Torch-free, so the command line can name the files, options and variables in its help.

* FVD: ``i3d_torchscript.pt``, the TorchScript port of the Kinetics-400 I3D of the original TensorFlow
  FVD (google-research ``frechet_video_distance``, tf.hub ``i3d-kinetics-400``) published by StyleGAN-V
  (universome/stylegan-v, ``src/metrics/frechet_video_distance.py``) and used by many FVD code bases
  (e.g. ``common_metrics_on_video_quality``, ``content-debiased-fvd``). Its SHA-256 is **not known to
  this project** (no verified digest was available when this was written); the digest of the file
  used is recorded in every result so runs can be compared.
* CLIP score: a local Hugging Face CLIP folder (``config.json``, weights, tokenizer and
  ``preprocessor_config.json``), e.g. a snapshot of ``openai/clip-vit-large-patch14`` (torchmetrics'
  default CLIP model).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CLIP_MODEL_ENV",
    "CLIP_SUGGESTED_MODEL",
    "I3D_WEIGHTS_ENV",
    "I3D_WEIGHTS_NAME",
    "I3D_WEIGHTS_URL",
    "how_to_get_clip_model",
    "how_to_get_i3d_weights",
    "resolve_clip_model",
    "resolve_i3d_weights",
]

I3D_WEIGHTS_ENV = "MHLA_I3D_WEIGHTS"
I3D_WEIGHTS_NAME = "i3d_torchscript.pt"
#: Where StyleGAN-V publishes the file (its ``compute_fvd``). Named in error messages only; nothing downloads.
I3D_WEIGHTS_URL = "https://www.dropbox.com/s/ge9e5ujwgetktms/i3d_torchscript.pt?dl=1"

CLIP_MODEL_ENV = "MHLA_CLIP_MODEL"
CLIP_SUGGESTED_MODEL = "openai/clip-vit-large-patch14"


def how_to_get_i3d_weights() -> str:
    """Where to get the I3D file and how to hand it over (for error messages)."""
    return (
        f"download {I3D_WEIGHTS_NAME} (StyleGAN-V's TorchScript Kinetics-400 I3D) from {I3D_WEIGHTS_URL} on a "
        f"machine with internet, copy it anywhere on this machine and pass --i3d-weights PATH or set "
        f"{I3D_WEIGHTS_ENV}=PATH"
    )


def how_to_get_clip_model() -> str:
    """Where to get a CLIP folder and how to hand it over (for error messages)."""
    return (
        f"on a machine with internet save a CLIP model folder, e.g. `hf download "
        f"{CLIP_SUGGESTED_MODEL} --local-dir clip-vit-large-patch14` (config.json, weights, tokenizer and "
        f"preprocessor_config.json), copy it here and pass --clip-model FOLDER or set {CLIP_MODEL_ENV}=FOLDER"
    )


def _given(path, env: str) -> tuple[str | None, str]:
    if path is None or str(path) == "":
        return os.environ.get(env) or None, f"${env}"
    return str(path), "the given path"


def resolve_i3d_weights(path: str | os.PathLike | None = None) -> Path:
    """The I3D file: ``path`` if given, else ``$MHLA_I3D_WEIGHTS``; an existing file or an error."""
    path, source = _given(path, I3D_WEIGHTS_ENV)
    if path is None:
        raise FileNotFoundError(
            f"no I3D weights file was given. FVD needs {I3D_WEIGHTS_NAME}: {how_to_get_i3d_weights()}"
        )
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise FileNotFoundError(
            f"I3D weights file {resolved} (from {source}) does not exist or is not a file: {how_to_get_i3d_weights()}"
        )
    return resolved


def resolve_clip_model(path: str | os.PathLike | None = None) -> Path:
    """The CLIP folder: ``path`` if given, else ``$MHLA_CLIP_MODEL``; a folder with ``config.json`` or an error."""
    path, source = _given(path, CLIP_MODEL_ENV)
    if path is None:
        raise FileNotFoundError(
            f"no CLIP model folder was given. The CLIP score needs a local CLIP model: {how_to_get_clip_model()}"
        )
    resolved = Path(path).expanduser()
    if not (resolved / "config.json").is_file():
        raise FileNotFoundError(
            f"CLIP model folder {resolved} (from {source}) does not exist or has no config.json: "
            f"{how_to_get_clip_model()}"
        )
    return resolved
