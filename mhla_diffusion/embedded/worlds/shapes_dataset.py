"""Write a moving-shapes dataset folder in the Wan trainer's format (:mod:`mhla_diffusion.finetune.video_data`).

Layout::

    folder/
      metadata.jsonl        # one row per clip: file_name, text, num_frames, height, width,
                            # shape, colour, direction (the last three are ignored by the trainer)
      clips/clip_00000.gif  # NUM_FRAMES (or bouncing_frames) x FRAME_SIZE x FRAME_SIZE RGB

GIF is the lossless video format the trainer reads (:mod:`mhla_diffusion.finetune.media`): a clip holds two
colours, so its palette is exact and the decoded frames equal the generated ones bit for bit.
``num_frames``/``height``/``width`` in the metadata let the trainer skip probing every file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import imageio.v3 as iio

from .bouncing_shapes import bouncing_clip
from .moving_shapes import FRAME_SIZE, shape_clip

__all__ = ["GIF_FRAME_MS", "write_shapes_dataset"]

#: Frame duration stored in the GIFs (10 fps; GIF delays are whole centiseconds).
GIF_FRAME_MS = 100


def write_shapes_dataset(
    folder: str | Path, num_clips: int, seed: int = 0, overwrite: bool = False, bouncing_frames: int | None = None
) -> Path:
    """Write clips ``0 .. num_clips - 1`` of the ``(num_clips, seed)`` dataset to ``folder``; returns it.

    ``bouncing_frames``: write bouncing-shapes clips (:mod:`.bouncing_shapes`) of that many frames instead of
    the moving-shapes clips (``NUM_FRAMES`` frames). An existing non-empty ``folder`` is an error unless
    ``overwrite``, which deletes it first.
    """
    folder = Path(folder)
    if num_clips < 1:
        raise ValueError(f"num_clips must be >= 1, got {num_clips}")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{folder} exists and is not empty; choose another folder or pass overwrite=True")
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(num_clips):
        if bouncing_frames is None:
            clip = shape_clip(k, num_clips, seed)
        else:
            clip = bouncing_clip(k, num_clips, seed, bouncing_frames)
        name = f"clips/clip_{k:05d}.gif"
        iio.imwrite(folder / name, clip.frames, extension=".gif", duration=GIF_FRAME_MS, loop=0)
        rows.append(
            {
                "file_name": name,
                "text": clip.caption,
                "num_frames": len(clip.frames),
                "height": FRAME_SIZE,
                "width": FRAME_SIZE,
                **clip.attributes,
            }
        )
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder
