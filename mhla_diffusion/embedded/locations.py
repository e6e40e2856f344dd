"""The small demonstration models that ship inside the package (no download, seconds on a CPU).

``mhla build-embedded`` (:mod:`mhla_diffusion.embedded.builds.build`) trains them from scratch and writes them to
``mhla_diffusion/embedded/models/``:

* ``shapes-t2v-softmax`` / ``shapes-t2v-mhla``: text-to-video, Wan2.1 architecture (our
  ``MHLAWanPipeline``), trained on procedural "moving shapes" clips (9 frames, 48x48);
* ``digits-c2i-softmax`` / ``digits-c2i-mhla``: class-to-image, DiT architecture, trained on
  scikit-learn's handwritten digits (32x32, classes "0" ... "9");
* ``shapes-long-mhla`` / ``shapes-long-softmax``: the streaming text-to-video models (block-causal MHLA, and
  its block-causal softmax teacher run with a KV cache), trained on bouncing-shapes clips of 17 frames and
  judged on videos 8x longer (``mhla build-embedded --stream``);
* ``judges/video`` / ``judges/image`` / ``judges/long-video``: the classifiers that score generated samples
  (the long-video judge reads 9-frame windows of bouncing shapes).

They are toy models that show the system working end to end, not substitutes for Wan2.1 or DiT-XL/2.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..utils.choices import ATTENTIONS, Attention

__all__ = [
    "EMBEDDED_ROOT",
    "EmbeddedDefaults",
    "EmbeddedFolder",
    "embedded_defaults",
    "embedded_folder",
    "embedded_judge",
    "embedded_model",
    "weight_hashes",
]

EMBEDDED_ROOT = Path(__file__).resolve().parent / "models"

Task = Literal["text-to-video", "class-to-image", "long-video"]
_FOLDERS = {"text-to-video": "shapes-t2v", "class-to-image": "digits-c2i", "long-video": "shapes-long"}
JudgeKind = Literal["video", "image", "long-video"]
#: The judge that scores each task's samples.
TASK_JUDGES: dict[str, JudgeKind] = {"text-to-video": "video", "class-to-image": "image", "long-video": "long-video"}


@dataclass(frozen=True)
class EmbeddedDefaults:
    """Generation settings the embedded models were trained for."""

    num_frames: int = 9
    height: int = 48
    width: int = 48
    fps: int = 8
    max_sequence_length: int = 16  # the text length the model was trained with
    video_steps: int = 20
    # Classifier-free guidance of the video model. On the 9x48x48 build's softmax teacher (48 prompts, judged):
    # 1.0-3.0 drew every prompt's shape, colour and direction, 4.0 85 %, 5.0 75 %; strong guidance pushes green
    # towards yellow and red.
    video_guidance_scale: float = 2.0
    image_steps: int = 25
    image_guidance_scale: float = 4.0


def embedded_defaults() -> EmbeddedDefaults:
    return EmbeddedDefaults()


def embedded_model(task: Task = "text-to-video", attention: Attention = "mhla", root: str | Path | None = None) -> Path:
    """Pipeline folder of an embedded model (``from_pretrained``-ready).

    Raises ``FileNotFoundError`` with the command that builds them when the folder is missing.
    """
    if task not in _FOLDERS:
        raise ValueError(f"task must be one of {', '.join(_FOLDERS)}; got {task!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}; got {attention!r}")
    folder = Path(root or EMBEDDED_ROOT) / f"{_FOLDERS[task]}-{attention}"
    if not (folder / "model_index.json").is_file():
        instead = (
            "give a block-causal MHLA pipeline folder instead (`mhla web --long-model FOLDER`, "
            "`mhla text-to-video --stream --model FOLDER`)"
            if task == "long-video"
            else "pass --model with a Diffusers pipeline folder"
        )
        raise FileNotFoundError(f"embedded model {folder} is missing: {_build_hint(task)}, or {instead}")
    return folder


def _build_hint(task: str) -> str:
    """What builds the embedded models (and judge) of ``task``: the streaming long-video ones come from
    ``mhla build-embedded --stream``, which no release has run yet, the others from ``mhla build-embedded``."""
    if task == "long-video":
        return (
            "no long-video model ships with the package yet: build the long-video models and judge with "
            "`mhla build-embedded --stream` (a training run on this machine that fine-tunes the package's "
            "text-to-video softmax teacher; a killed build resumes where it stopped)"
        )
    return "rebuild the demonstration models with `mhla build-embedded`"


def embedded_judge(kind: JudgeKind, root: str | Path | None = None) -> Path:
    """Folder of an embedded judge (load with :func:`mhla_diffusion.embedded.load_judge`)."""
    if kind not in TASK_JUDGES.values():
        raise ValueError(f"kind must be one of {', '.join(TASK_JUDGES.values())}; got {kind!r}")
    folder = Path(root or EMBEDDED_ROOT) / "judges" / kind
    if not folder.is_dir():
        task = next(task for task, judge in TASK_JUDGES.items() if judge == kind)
        raise FileNotFoundError(f"embedded judge {folder} is missing: {_build_hint(task)}")
    return folder


@dataclass(frozen=True)
class EmbeddedFolder:
    """An embedded model folder: its task, its attention (the folder name's suffix, e.g. ``mhla``) and the
    folder that holds it beside the judges (``mhla_diffusion/embedded/models``, or a ``build-embedded --output``)."""

    task: Task
    attention: str
    root: Path

    def judge(self) -> Path:
        """The folder of the judge that scores this model's samples."""
        return embedded_judge(TASK_JUDGES[self.task], self.root)


def embedded_folder(model: str | Path) -> EmbeddedFolder | None:
    """What ``model`` is when it is an embedded model folder as ``mhla build-embedded`` exports them
    (``<root>/shapes-t2v-<attention>``, ``<root>/shapes-long-<attention>`` or ``<root>/digits-c2i-<attention>``,
    with a pipeline in it and ``<root>/judges/`` beside it), else ``None`` (a hub id, any other folder)."""
    path = Path(model)
    if not (path / "model_index.json").is_file():
        return None
    path = path.resolve()
    if not (path.parent / "judges").is_dir():
        return None
    for task, prefix in _FOLDERS.items():
        if path.name.startswith(prefix + "-"):
            return EmbeddedFolder(task, path.name[len(prefix) + 1 :], path.parent)  # type: ignore[arg-type]
    return None


def weight_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every ``.safetensors`` file under ``folder``, by path relative to it (``/``-separated):
    what ties committed models to the build report that made them, and an experiment's results
    to the VAE and judge it used."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.safetensors"))
    }
