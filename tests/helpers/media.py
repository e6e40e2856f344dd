"""Writers of synthetic media on disk (videos, images, class folders, captioned clip folders) and
synthetic uint8 image arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

COLORS = {"red": (230, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (230, 220, 40)}


def write_video(
    path: Path, frames: int, height: int, width: int, color=(230, 30, 30), direction: str = "right"
) -> Path:
    """An mp4 of a coloured square moving across a dark background (H.264, 8 fps)."""
    import imageio

    images = []
    for t in range(frames):
        image = np.full((height, width, 3), 20, np.uint8)
        size = max(4, min(height, width) // 3)
        x = (2 + 2 * t) % (width - size) if direction == "right" else (width - size - 2 - 2 * t) % (width - size)
        top = (height - size) // 2
        image[top : top + size, x : x + size] = color
        images.append(image)
    with imageio.get_writer(
        path,
        format="FFMPEG",
        mode="I",
        fps=8,
        codec="libx264",
        macro_block_size=1,
        ffmpeg_log_level="error",
        output_params=["-pix_fmt", "yuv420p"],
    ) as writer:
        for image in images:
            writer.append_data(image)
    return path


def write_image(path: Path, height: int, width: int, color=(200, 200, 200)) -> Path:
    """A PNG (or any PIL format by suffix) of a ``color`` square on a dark background."""
    image = np.full((height, width, 3), 20, np.uint8)
    image[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = color
    Image.fromarray(image).save(path)
    return path


def make_video_set(folder: Path, frames: int = 10, height: int = 32, width: int = 32, with_image: bool = True) -> Path:
    """8 captioned clips (4 colours x 2 directions) and, optionally, one captioned image."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, color) in enumerate(COLORS.items()):
        for j, direction in enumerate(("left", "right")):
            stem = f"clip{2 * i + j}"
            write_video(folder / f"{stem}.mp4", frames, height, width, color, direction)
            (folder / f"{stem}.txt").write_text(f"a {name} square moving {direction}")
    if with_image:
        write_image(folder / "still.png", height, width)
        (folder / "still.txt").write_text("a white square")
    return folder


def one_colour_clips(folder: Path, count: int, size: int) -> Path:
    """``count`` captioned clips, each one random colour with a moving square of it (caption "a video")."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        color = tuple(int(v) for v in rng.integers(0, 256, 3))
        write_video(folder / f"clip{i}.mp4", 10, size, size, color, "left" if i % 2 else "right")
        (folder / f"clip{i}.txt").write_text("a video")
    return folder


def make_image_classes(folder: Path) -> Path:
    """Class folders 0, 1, 2 of four 20x24 noisy colour images each (class ``c`` bright in channel ``c``)."""
    rng = np.random.default_rng(0)
    for label in range(3):
        (folder / str(label)).mkdir(parents=True)
        for i in range(4):
            image = np.zeros((20, 24, 3), np.uint8)
            image[..., label] = 190
            image += rng.integers(0, 50, image.shape, dtype=np.uint8)
            Image.fromarray(image).save(folder / str(label) / f"{i}.png")
    return folder


def make_digit_classes(folder: Path, classes: int = 10, per_class: int = 2, size: int = 32) -> Path:
    """Class folders ``0``..``classes-1`` of ``size`` px images, each class its own bar position."""
    rng = np.random.default_rng(0)
    for label in range(classes):
        (folder / str(label)).mkdir(parents=True)
        for i in range(per_class):
            image = rng.integers(0, 40, (size, size, 3), dtype=np.uint8)
            row = label * size // classes
            image[row : row + max(1, size // classes)] = 220
            Image.fromarray(image).save(folder / str(label) / f"{i}.png")
    return folder


def random_images(n: int, size: int | tuple[int, int] = 16, seed: int = 0, low: int = 0, high: int = 256) -> np.ndarray:
    """uint8 ``(n, H, W, 3)`` uniform noise in ``[low, high)``."""
    h, w = (size, size) if isinstance(size, int) else size
    return np.random.default_rng(seed).integers(low, high, size=(n, h, w, 3), dtype=np.uint8)


def smooth_images(n: int, size: int = 16, seed: int = 0, brightness: float = 0.0) -> np.ndarray:
    """uint8 ``(n, size, size, 3)`` random colour gradients (a distribution unlike :func:`random_images`)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, size)
    base = rng.uniform(0, 255, size=(n, 1, 1, 3))
    slope_y, slope_x = rng.uniform(-120, 120, size=(2, n, 1, 1, 3))
    images = base + slope_y * ramp[None, :, None, None] + slope_x * ramp[None, None, :, None] + brightness
    return np.clip(images, 0, 255).astype(np.uint8)


def write_folder(folder: Path, images: np.ndarray, fmt: str = "png") -> list[Path]:
    """Save ``images`` (uint8 NHWC) as ``folder/00000.<fmt>``, ...; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = folder / f"{i:05d}.{fmt}"
        Image.fromarray(image).save(path)
        paths.append(path)
    return paths
