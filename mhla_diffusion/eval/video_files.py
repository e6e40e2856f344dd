"""Folders of generated videos for the video metrics: the files, their frames, their prompts.

A samples folder holds ``.mp4`` files (as ``mhla text-to-video`` writes them); each may have a
sidecar ``<stem>.json`` beside it whose ``"prompt"`` is the text it was generated from. A prompts
file instead gives one prompt per line, in the sorted order of the video file names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["VIDEO_SUFFIXES", "list_videos", "read_prompts", "read_video"]

VIDEO_SUFFIXES = (".mp4",)


def list_videos(folder: str | os.PathLike) -> list[Path]:
    """The ``.mp4`` files directly in ``folder``, sorted by name; an error if there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of videos")
    videos = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES)
    if not videos:
        raise ValueError(f"{folder} has no {'/'.join(VIDEO_SUFFIXES)} files")
    return videos


def read_video(path: str | os.PathLike, max_frames: int | None = None) -> np.ndarray:
    """All frames (or the first ``max_frames``) of a video file as uint8 ``(F, H, W, 3)``."""
    import imageio

    frames = []
    try:
        with imageio.get_reader(str(path), format="FFMPEG") as reader:
            for frame in reader:
                frames.append(np.asarray(frame)[..., :3])
                if max_frames is not None and len(frames) >= max_frames:
                    break
    except (OSError, RuntimeError, ValueError) as error:
        raise ValueError(f"cannot read video {path}: {error}") from None
    if not frames:
        raise ValueError(f"video {path} has no frames")
    return np.stack(frames).astype(np.uint8, copy=False)


def read_prompts(videos: Sequence[Path], prompts_file: str | os.PathLike | None = None) -> list[str]:
    """One prompt per video: from ``prompts_file`` (one a line, sorted-name order) or the sidecar JSONs."""
    if prompts_file is not None:
        lines = [line.strip() for line in Path(prompts_file).read_text(encoding="utf-8").splitlines()]
        prompts = [line for line in lines if line]
        if len(prompts) != len(videos):
            raise ValueError(
                f"--prompts {prompts_file} has {len(prompts)} prompts for {len(videos)} videos "
                "(one a line, in the sorted order of the video file names)"
            )
        return prompts
    prompts = []
    for video in videos:
        sidecar = video.with_suffix(".json")
        if not sidecar.is_file():
            raise FileNotFoundError(
                f"{video} has no sidecar {sidecar.name} with its prompt: give --prompts FILE "
                "(one prompt a line, in the sorted order of the video file names)"
            )
        try:
            prompt = json.loads(sidecar.read_text(encoding="utf-8")).get("prompt")
        except (json.JSONDecodeError, AttributeError) as error:
            raise ValueError(f"{sidecar} is not a JSON object: {error}") from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f'{sidecar} has no "prompt" text')
        prompts.append(prompt)
    return prompts
