"""Reading training media: probe and decode videos (ffmpeg from imageio-ffmpeg) and images (PIL),
then resize and centre-crop to a bucket.

Decoded pixels are ``float32`` in ``[-1, 1]``: videos ``(3, F, H, W)``, images ``(3, H, W)``.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "IMAGE_EXTENSIONS",
    "MediaError",
    "MediaInfo",
    "VIDEO_EXTENSIONS",
    "adm_center_crop",
    "is_media",
    "probe",
    "read_image",
    "read_video_frames",
    "resize_center_crop",
]

VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v", ".gif"})
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})

_SIZE = re.compile(r"Video:.*?\b(\d{2,5})x(\d{2,5})\b")
_FRAMES = re.compile(r"frame=\s*(\d+)")
_ROTATION = re.compile(r"rotation of (-?\d+(?:\.\d+)?) degrees")


class MediaError(RuntimeError):
    """A file that cannot be read as a video or image (corrupt, truncated, wrong format)."""


@dataclass(frozen=True)
class MediaInfo:
    """Frame count and size (as decoded, rotation applied) of one file; images have one frame."""

    num_frames: int
    height: int
    width: int
    is_video: bool


def is_media(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTENSIONS | IMAGE_EXTENSIONS


def probe(path: str | Path) -> MediaInfo:
    """Frame count and size of a video or image, without decoding the video (ffmpeg stream copy)."""
    path = Path(path)
    if path.suffix.lower() in IMAGE_EXTENSIONS:
        from PIL import Image

        try:
            with Image.open(path) as image:
                image.verify()
                width, height = image.size
        except Exception as err:  # PIL raises many types for broken files
            raise MediaError(f"{path}: not a readable image ({err})") from None
        return MediaInfo(1, height, width, is_video=False)
    import imageio_ffmpeg

    command = [
        imageio_ffmpeg.get_ffmpeg_exe(),
        "-hide_banner",
        "-nostdin",
        "-i",
        str(path),
        "-map",
        "0:v:0",
        "-c",
        "copy",
        "-f",
        "null",
        "-",
    ]
    result = subprocess.run(command, capture_output=True)
    log = result.stderr.decode(errors="ignore")
    size, frames = _SIZE.search(log), _FRAMES.findall(log)
    if result.returncode != 0 or size is None or not frames or int(frames[-1]) < 1:
        last = log.strip().splitlines()[-1] if log.strip() else f"exit code {result.returncode}"
        raise MediaError(f"{path}: not a readable video ({last})")
    width, height = int(size.group(1)), int(size.group(2))
    rotation = _ROTATION.search(log)
    if rotation and round(abs(float(rotation.group(1)))) % 180 == 90:  # ffmpeg auto-rotates on decode
        width, height = height, width
    return MediaInfo(int(frames[-1]), height, width, is_video=True)


def read_video_frames(path: str | Path, indices: list[int]) -> np.ndarray:
    """Decode the frames at ascending ``indices`` -> ``uint8`` ``(F, H, W, 3)``; stops reading after the last one."""
    import imageio_ffmpeg

    wanted = sorted(set(indices))
    if wanted != list(indices):
        raise ValueError("frame indices must be ascending and distinct")
    try:
        reader = imageio_ffmpeg.read_frames(str(path))
        meta = next(reader)
        width, height = meta["size"]
        frames, position, target = [], 0, iter(wanted)
        want = next(target)
        for raw in reader:
            if position == want:
                frames.append(np.frombuffer(raw, np.uint8).reshape(height, width, 3))
                want = next(target, None)
                if want is None:
                    break
            position += 1
        reader.close()
    except MediaError:
        raise
    except Exception as err:
        raise MediaError(f"{path}: decoding failed ({err})") from None
    if len(frames) != len(wanted):
        raise MediaError(f"{path}: decoded only {position} frames, needed {wanted[-1] + 1}")
    return np.stack(frames)


def read_image(path: str | Path) -> np.ndarray:
    """RGB ``uint8`` ``(H, W, 3)``."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except Exception as err:
        raise MediaError(f"{path}: not a readable image ({err})") from None


def resize_center_crop(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """``uint8`` ``(F, H, W, 3)`` -> ``float32`` ``(3, F, height, width)`` in ``[-1, 1]``.

    Scales (antialiased bilinear) so the frame covers the target, then crops the centre.
    """
    video = torch.from_numpy(np.array(frames)).permute(0, 3, 1, 2).float()  # (F, 3, H, W); a writable copy
    src_h, src_w = video.shape[-2:]
    scale = max(height / src_h, width / src_w)
    new_h, new_w = max(height, math.ceil(src_h * scale - 1e-6)), max(width, math.ceil(src_w * scale - 1e-6))
    if (new_h, new_w) != (src_h, src_w):
        video = F.interpolate(video, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    video = video[..., top : top + height, left : left + width]
    return (video / 127.5 - 1.0).clamp(-1, 1).permute(1, 0, 2, 3).contiguous()


def adm_center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """ADM / DiT centre crop: halve with BOX while the short side >= 2*size, BICUBIC to size, crop.

    ``uint8`` ``(H, W, 3)`` -> ``uint8`` ``(size, size, 3)``.
    """
    from PIL import Image

    pil = Image.fromarray(image)
    while min(*pil.size) >= 2 * size:
        pil = pil.resize(tuple(x // 2 for x in pil.size), resample=Image.BOX)
    scale = size / min(*pil.size)
    pil = pil.resize(tuple(round(x * scale) for x in pil.size), resample=Image.BICUBIC)
    array = np.asarray(pil)
    top, left = (array.shape[0] - size) // 2, (array.shape[1] - size) // 2
    return array[top : top + size, left : left + size]
