"""Saving and loading judges: ``judge.safetensors`` (weights) + ``judge_config.json`` (kind, sizes, notes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ...loaders.weight_files import read_checkpoint_file
from .image_judge import ImageJudge
from .judge_features import ImageJudgeFeatures, VideoJudgeFeatures, judge_features
from .video_judge import VideoJudge

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_judge", "load_judge_features", "save_judge"]

WEIGHTS_NAME = "judge.safetensors"
CONFIG_NAME = "judge_config.json"
_KINDS = {"video": VideoJudge, "image": ImageJudge}


def save_judge(
    judge: VideoJudge | ImageJudge, folder: str | Path, metadata: dict[str, Any] | None = None, overwrite: bool = False
) -> Path:
    """Write ``folder/judge.safetensors`` and ``folder/judge_config.json``; returns ``folder``.

    ``metadata`` (JSON-ready: e.g. training settings, held-out accuracy) is stored in the config.
    """
    if not isinstance(judge, (VideoJudge, ImageJudge)):
        raise ValueError(f"expected a VideoJudge or ImageJudge, got {type(judge).__name__}")
    folder = Path(folder)
    existing = [folder / name for name in (WEIGHTS_NAME, CONFIG_NAME) if (folder / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} already exists; choose another folder or pass overwrite=True")
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in judge.state_dict().items()}, str(folder / WEIGHTS_NAME))
    config = {"kind": judge.kind, "config": judge.config, "metadata": metadata or {}}
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _read(folder: Path) -> tuple[dict, Path]:
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: {folder} is not a saved judge (see save_judge)")
    config = json.loads(config_path.read_text())
    if config.get("kind") not in _KINDS:
        raise ValueError(f"{config_path}: unknown judge kind {config.get('kind')!r}; expected one of {sorted(_KINDS)}")
    return config, weights_path


def load_judge(folder: str | Path) -> VideoJudge | ImageJudge:
    """The judge saved in ``folder``, in eval mode; its config's ``metadata`` is in ``judge.metadata``."""
    config, weights_path = _read(Path(folder))
    judge = _KINDS[config["kind"]](**config["config"])
    missing, unexpected = judge.load_state_dict(read_checkpoint_file(weights_path), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    judge.metadata = config.get("metadata", {})
    return judge.eval()


def load_judge_features(folder: str | Path) -> VideoJudgeFeatures | ImageJudgeFeatures:
    """The saved judge as an evaluator feature network, naming its weights file and SHA-256."""
    weights_path = Path(folder) / WEIGHTS_NAME
    judge = load_judge(folder)
    digest = hashlib.sha256(weights_path.read_bytes()).hexdigest()
    return judge_features(judge, str(weights_path), digest)
