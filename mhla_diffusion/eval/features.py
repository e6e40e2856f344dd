"""The feature-network interface every metric reads from, and the sFID layout rule.

A feature network takes uint8 RGB images ``(N, 3, H, W)`` (values 0..255, any H, W: it resizes
itself) and returns a dict of float32 tensors:

* ``pool``: ``(N, D)``, the features for FID and precision/recall (Inception pool_3, D = 2048);
* ``spatial``: ``(N, h, w, c)``, channels-last, already cut to the sFID channels
  (Inception ``mixed_6/conv``: 17 x 17 x 7); flattened row-major this is the ADM (h, w, c) order;
* ``logits_unbiased``: ``(N, K)``, classifier logits without the bias, for the Inception Score
  (K = 1008).

:class:`~mhla_diffusion.eval.inception.InceptionV3Features` is the real network; the tests use a
small stand-in with the same interface.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

__all__ = ["FEATURE_KEYS", "FeatureExtractor", "check_uint8_images", "exact_float32", "flatten_spatial", "spatial_features"]

FEATURE_KEYS = ("pool", "spatial", "logits_unbiased")


class FeatureExtractor(nn.Module):
    """Base class of feature networks: ``forward(uint8 (N, 3, H, W)) -> {pool, spatial, logits_unbiased}``.

    Subclasses set ``name``, ``pool_dim`` (D), ``spatial_shape`` ((h, w, c)), ``num_logits`` (K),
    ``weights_path`` and ``weights_sha256`` (None for networks without a weights file), and stay in
    eval mode whatever ``train()`` is asked.
    """

    name: str = "feature-extractor"
    pool_dim: int
    spatial_shape: tuple[int, int, int]
    num_logits: int
    weights_path: str | None = None
    weights_sha256: str | None = None

    @property
    def spatial_dim(self) -> int:
        """Length of a flattened sFID feature, ``h * w * c`` (2023 for Inception)."""
        h, w, c = self.spatial_shape
        return h * w * c

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        return torch.device("cpu")

    def train(self, mode: bool = True) -> "FeatureExtractor":
        # BatchNorm statistics must never move: a feature network is always in eval mode.
        return super().train(False)

    def info(self) -> dict:
        """What a report needs to name the network: name, feature sizes, weights file and SHA-256."""
        return {
            "name": self.name,
            "pool_dim": self.pool_dim,
            "spatial_shape": list(self.spatial_shape),
            "num_logits": self.num_logits,
            "weights_path": self.weights_path,
            "weights_sha256": self.weights_sha256,
        }


def check_uint8_images(images: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``images`` is a uint8 tensor of shape ``(N, 3, H, W)``."""
    if not torch.is_tensor(images) or images.dtype != torch.uint8:
        raise ValueError(f"feature networks take uint8 images with values 0..255, got {getattr(images, 'dtype', type(images))}")
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"feature networks take RGB images of shape (N, 3, H, W), got {tuple(images.shape)}")


def spatial_features(feature_map: torch.Tensor, channels: int) -> torch.Tensor:
    """First ``channels`` channels of an NCHW map ``(N, C, h, w)``, channels-last: ``(N, h, w, channels)``."""
    if feature_map.dim() != 4 or feature_map.shape[1] < channels:
        raise ValueError(f"expected an (N, C>={channels}, h, w) feature map, got {tuple(feature_map.shape)}")
    return feature_map[:, :channels].permute(0, 2, 3, 1)


def flatten_spatial(spatial: torch.Tensor) -> torch.Tensor:
    """``(N, h, w, c) -> (N, h * w * c)`` with flat index ``(y * w + x) * c + channel`` (ADM's order)."""
    return spatial.reshape(spatial.shape[0], -1)


@contextmanager
def exact_float32() -> Iterator[None]:
    """Switch TF32 off for convolutions and matmuls (Ampere and later GPUs) while extracting features."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
