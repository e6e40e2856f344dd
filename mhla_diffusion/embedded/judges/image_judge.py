"""The image judge: a small 2D conv net that names the digit in a 32x32 image (:func:`class_accuracy`).

Trained only on real digits (the train side of :func:`~.digits.split_digits`), never on samples.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...pipelines.outputs import float_to_uint8
from ...training.loop import LoopProgress, step_generator
from ..worlds.digits import DIGIT_SIZE, NUM_DIGIT_CLASSES
from .judge_training import fit_judge

__all__ = [
    "ImageJudge",
    "class_accuracy",
    "images_to_tensor",
    "predict_classes",
    "tensor_to_uint8",
    "train_image_judge",
]


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())


class ImageJudge(nn.Module):
    """Images ``(N, 3, S, S)`` in ``[-1, 1]`` (S = ``image_size``) -> class logits ``(N, num_classes)``.

    Trunk: conv blocks at S, S/2 and S/4 (GroupNorm, so train and eval mode agree); ``embed`` averages
    the last map ``(N, 2 * width, S/4, S/4)`` down to 4x4 and projects it to ``embed_dim`` (the pool features).
    """

    kind = "image"

    def __init__(
        self, width: int = 32, embed_dim: int = 64, num_classes: int = NUM_DIGIT_CLASSES, image_size: int = DIGIT_SIZE
    ):
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image_size must be a multiple of 4, got {image_size}")
        self.config = {"width": width, "embed_dim": embed_dim, "num_classes": num_classes, "image_size": image_size}
        self.trunk = nn.Sequential(
            _block(3, width),
            nn.MaxPool2d(2),
            _block(width, 2 * width),
            nn.MaxPool2d(2),
            _block(2 * width, 2 * width),
        )
        self.project = nn.Sequential(nn.Linear(2 * width * 16, embed_dim), nn.SiLU())
        self.head = nn.Linear(embed_dim, num_classes)

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        """``(N, 3, S, S)`` -> ``(N, 2 * width, S / 4, S / 4)``."""
        size = self.config["image_size"]
        if images.dim() != 4 or tuple(images.shape[1:]) != (3, size, size):
            raise ValueError(f"the image judge takes images (N, 3, {size}, {size}), got {tuple(images.shape)}")
        return self.trunk(images)

    def embed(self, feature_map: torch.Tensor) -> torch.Tensor:
        """Last conv map -> pool features ``(N, embed_dim)``."""
        # Pool to 4x4, not to 1x1: where the strokes are (a 6 vs a 9) is what names the digit.
        return self.project(F.adaptive_avg_pool2d(feature_map, 4).flatten(1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(self.feature_map(images)))


def images_to_tensor(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 images ``(N, H, W, 3)`` -> float ``(N, 3, H, W)`` in ``[-1, 1]``."""
    images = torch.as_tensor(np.asarray(images)) if not torch.is_tensor(images) else images
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype} {tuple(images.shape)}")
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def tensor_to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`images_to_tensor` (and of ``clips_to_tensor``): float ``(N, 3, ...)`` in ``[-1, 1]``
    (clamped) -> uint8 channels-last ``(N, ..., 3)``, by the project's one rule (:func:`float_to_uint8`)."""
    return float_to_uint8(((pixels.double() + 1) / 2).movedim(1, -1).numpy())


@torch.inference_mode()
def predict_classes(judge: ImageJudge, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """uint8 images ``(N, S, S, 3)`` -> predicted classes int64 ``(N,)``."""
    judge.eval()
    out = [judge(images_to_tensor(images[i : i + batch_size])).argmax(-1) for i in range(0, len(images), batch_size)]
    return torch.cat(out).numpy() if out else np.zeros(0, np.int64)


def class_accuracy(
    judge: ImageJudge, images: np.ndarray, labels: np.ndarray | list[int], batch_size: int = 256
) -> float:
    """Fraction of uint8 ``images`` ``(N, S, S, 3)`` judged to be their ``labels`` ``(N,)``."""
    images, labels = np.asarray(images), np.asarray(labels)
    if len(images) == 0:
        raise ValueError("class_accuracy needs at least one image")
    if labels.shape != (len(images),):
        raise ValueError(f"labels must have shape ({len(images)},), got {labels.shape}")
    num_classes = judge.config["num_classes"]
    if ((labels < 0) | (labels >= num_classes)).any():
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    return float((predict_classes(judge, images, batch_size) == labels).mean())


def _shift(batch: torch.Tensor, generator: torch.Generator, max_shift: int) -> torch.Tensor:
    """Random translation by up to ``max_shift`` pixels per image (background -1 fills the gap)."""
    padded = F.pad(batch, (max_shift,) * 4, value=-1.0)
    size = batch.shape[-1]
    offsets = torch.randint(0, 2 * max_shift + 1, (len(batch), 2), generator=generator)
    return torch.stack([p[:, y : y + size, x : x + size] for p, (y, x) in zip(padded, offsets.tolist())])


def train_image_judge(
    images: np.ndarray,
    labels: np.ndarray,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    max_shift: int = 2,
    width: int = 32,
    embed_dim: int = 64,
    num_classes: int = NUM_DIGIT_CLASSES,
    progress: LoopProgress | None = None,
) -> ImageJudge:
    """Train an :class:`ImageJudge` on uint8 ``images`` ``(N, S, S, 3)`` and ``labels`` ``(N,)``.

    Seeded minibatches with random shifts of up to ``max_shift`` pixels, AdamW with cosine decay.
    ``progress``: bar and resumable checkpoint (:class:`~mhla_diffusion.training.loop.LoopProgress`).
    """
    images, labels = np.asarray(images), np.asarray(labels)
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"steps and batch_size must be >= 1 and lr > 0, got {steps}, {batch_size}, {lr}")
    if labels.shape != (len(images),) or len(images) == 0:
        raise ValueError(f"need images (N >= 1, S, S, 3) and labels (N,), got {images.shape} and {labels.shape}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got {labels.min()}..{labels.max()}")
    data, targets = images_to_tensor(images), torch.as_tensor(labels, dtype=torch.int64)
    torch.manual_seed(seed)
    judge = ImageJudge(width=width, embed_dim=embed_dim, num_classes=num_classes, image_size=images.shape[1])

    def batch_loss(step: int) -> torch.Tensor:
        generator = step_generator(seed, step)
        pick = torch.randint(0, len(data), (batch_size,), generator=generator)
        batch = _shift(data[pick], generator, max_shift) if max_shift else data[pick]
        return F.cross_entropy(judge(batch), targets[pick])

    return fit_judge(judge, steps, lr, batch_loss, "image judge", progress)
