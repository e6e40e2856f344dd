"""Helpers for the evaluation tests: a stand-in feature network, image makers, a network guard.

Not a ``conftest.py``: pytest imports every ``conftest.py`` as the module ``conftest``, and one here
would shadow ``tests/conftest.py`` for the top-level tests' ``from conftest import ...``.
Test modules import what they need from here (fixtures included, which registers them).
"""

from __future__ import annotations

import socket
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x

from mhla_diffusion.eval.features import FeatureExtractor, check_uint8_images, spatial_features


class StandInFeatures(FeatureExtractor):
    """A 3-conv network with the Inception extractor's interface, at toy size and fixed-seed weights.

    Same preprocessing as the real one (TF1 legacy bilinear resize, here to 32 x 32, then
    ``(x - 128) / 128``); pool ``(N, 16)``, spatial ``(N, 4, 4, 7)`` (first 7 channels of the last
    4 x 4 map, channels-last), unbiased logits ``(N, 10)``.
    """

    name = "stand-in"
    pool_dim = 16
    spatial_shape = (4, 4, 7)
    num_logits = 10
    input_size = 32

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(8, 12, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(12, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
        self.requires_grad_(False)
        self.eval()

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        check_uint8_images(images)
        x = interpolate_bilinear_2d_like_tensorflow1x(images.float(), size=(self.input_size,) * 2, align_corners=False)
        x = (x - 128) / 128
        x = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        fmap = torch.tanh(self.conv3(x))  # (N, 16, 4, 4)
        pool = fmap.mean((2, 3))
        return {"pool": pool, "spatial": spatial_features(fmap, 7), "logits_unbiased": pool @ self.fc.weight.T}


class PoolOnly(nn.Module):
    """The stand-in's pool features as a plain ``(N, D)`` module, for torchmetrics' custom-feature FID."""

    def __init__(self, net: StandInFeatures) -> None:
        super().__init__()
        self.net = net
        self.num_features = net.pool_dim

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)["pool"]


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


def inception_template_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with the keys and shapes of torch-fidelity's Inception, randomly initialised.

    Built by constructing the real module with its weight loading switched off (nothing downloads).
    """
    from torch_fidelity import feature_extractor_inceptionv3 as module

    torch.manual_seed(seed)
    with mock.patch.object(module, "load_state_dict_from_url", lambda *a, **k: {}), \
            mock.patch.object(module.FeatureExtractorInceptionV3, "load_state_dict", lambda self, *a, **k: None):
        net = module.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any test that tries to open a network connection."""

    def refuse(*args, **kwargs):
        raise AssertionError("evaluation tests must not use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def standin() -> StandInFeatures:
    return StandInFeatures()


__all__ = [
    "PoolOnly",
    "StandInFeatures",
    "inception_template_state_dict",
    "no_network",
    "random_images",
    "smooth_images",
    "standin",
    "write_folder",
]
