"""Video evaluation: FVD (:mod:`.fvd`) and CLIP score (:mod:`.clip_score`) of a folder of generated videos.

    from mhla_diffusion.eval.video import evaluate_videos
    result = evaluate_videos("samples/", "real/", i3d=I3DFeatures("i3d_torchscript.pt"),
                             clip=VideoCLIPScore("clip-vit-large-patch14/"), prompts=None)

The reference for FVD is a folder of videos or an ``.npz`` of I3D ``mu``/``sigma``
(:func:`~.fvd.save_fvd_reference`, ``mhla eval-video --save-ref``). Networks are built by the caller
from files it resolved (:mod:`.video_weights`); this module never downloads anything. The embedded
models' judge-based numbers are added by the command (``mhla eval-video --judge embedded``) with
:mod:`mhla_diffusion.embedded.builds.reproduction`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .frechet import frechet_distance
from .fvd import I3DFeatures, fvd_stats, load_fvd_reference, save_fvd_reference
from .video_files import list_videos, read_prompts, read_video

__all__ = ["evaluate_videos", "fvd_of_folders", "iter_videos"]


def iter_videos(paths: Sequence[Path], max_frames: int | None = None) -> Iterator[np.ndarray]:
    """uint8 frames ``(F, H, W, 3)`` of each file in turn."""
    for path in paths:
        yield read_video(path, max_frames)


def _reference_stats(ref: Path, i3d: I3DFeatures, batch_size: int, save_ref: Path | None, overwrite: bool):
    info = i3d.info()
    if ref.suffix == ".npz" and ref.is_file():
        if save_ref is not None:
            raise ValueError("--save-ref needs a reference folder of videos, not an .npz")
        return load_fvd_reference(ref, info), {"path": str(ref), "statistics": "npz"}
    videos = list_videos(ref)
    stats = fvd_stats(iter_videos(videos, i3d.num_frames), i3d, batch_size)
    described = {"path": str(ref), "statistics": "computed", "count": len(videos)}
    if save_ref is not None:
        described["saved_to"] = str(save_fvd_reference(stats, save_ref, info, overwrite=overwrite))
    return stats, described


def fvd_of_folders(
    samples: str | os.PathLike,
    ref: str | os.PathLike,
    i3d: I3DFeatures,
    batch_size: int = 8,
    save_ref: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> dict:
    """``{"fvd", "samples", "reference"}`` of a folder of videos against a folder or ``.npz``."""
    videos = list_videos(samples)
    sample_stats = fvd_stats(iter_videos(videos, i3d.num_frames), i3d, batch_size)
    ref_stats, reference = _reference_stats(Path(ref), i3d, batch_size, Path(save_ref) if save_ref else None, overwrite)
    if ref_stats.dim != sample_stats.dim:
        raise ValueError(
            f"the reference holds {ref_stats.dim}-d features, the I3D file gives {sample_stats.dim}-d: "
            "it was computed with another network"
        )
    return {
        "fvd": frechet_distance(sample_stats, ref_stats),
        "samples": {"count": len(videos)},
        "reference": reference,
        "feature_dim": sample_stats.dim,
    }


def _known_prompts(
    videos: Sequence[Path], prompts: str | os.PathLike | Sequence[str] | None, required: bool
) -> list[str] | None:
    """The videos' prompts: given as texts, read from a prompts file or the sidecars; when not ``required``,
    None where they cannot be read (an FVD-only run needs none)."""
    if prompts is not None and not isinstance(prompts, (str, os.PathLike)):
        texts = list(prompts)
        if len(texts) != len(videos):
            raise ValueError(f"{len(texts)} prompts for {len(videos)} videos")
        return texts
    try:
        return read_prompts(videos, prompts)
    except (OSError, ValueError):
        if required:
            raise
        return None


def evaluate_videos(
    samples: str | os.PathLike,
    ref: str | os.PathLike | None = None,
    *,
    i3d: I3DFeatures | None = None,
    clip=None,
    prompts: str | os.PathLike | Sequence[str] | None = None,
    batch_size: int = 8,
    save_ref: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> dict:
    """FVD (when ``i3d`` and ``ref`` are given) and CLIP score (when ``clip`` is given) of ``samples``.

    ``prompts``: a prompts file (one a line, sorted-name order), the texts themselves, or None for the
    sidecar JSONs; the CLIP score needs them, otherwise they are recorded when readable.
    Returns a JSON-ready dict: ``metrics`` (``fvd``, ``clip_score``; None when not computed),
    ``samples``, ``reference``, ``networks`` and ``per_video`` (file, prompt when known, CLIP score).
    """
    videos = list_videos(samples)
    texts = _known_prompts(videos, prompts, required=clip is not None)
    rows = [{"file": p.name} for p in videos]
    for row, text in zip(rows, texts or []):
        row["prompt"] = text
    result: dict = {
        "metrics": {"fvd": None, "clip_score": None},
        "samples": {"path": str(samples), "count": len(videos)},
        "reference": None,
        "networks": {},
        "per_video": rows,
    }
    if i3d is not None:
        if ref is None:
            raise ValueError("FVD needs a reference: a folder of videos or an FVD .npz")
        fvd = fvd_of_folders(samples, ref, i3d, batch_size, save_ref, overwrite)
        result["metrics"]["fvd"] = fvd["fvd"]
        result["reference"] = fvd["reference"]
        result["networks"]["i3d"] = {**i3d.info(), "feature_dim": fvd["feature_dim"]}
    if clip is not None:
        scores = clip(iter_videos(videos), texts)
        result["metrics"]["clip_score"] = scores["clip_score"]
        result["networks"]["clip"] = clip.info()
        for row, score in zip(result["per_video"], scores["per_video"]):
            row["clip_score"] = score
    return result
