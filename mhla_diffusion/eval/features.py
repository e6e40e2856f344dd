"""The feature-network interface every metric reads from, and the sFID layout rule.

A feature network takes uint8 RGB images ``(N, 3, H, W)`` (values 0..255, any H, W: it resizes
itself) and returns a dict of float32 tensors:

* ``pool``: ``(N, D)``, the features for FID and precision/recall (Inception pool_3, D = 2048);
* ``spatial``: ``(N, h, w, c)``, channels-last, already cut to the sFID channels
  (Inception ``mixed_6/conv``: 17 x 17 x 7); flattened row-major this is the ADM (h, w, c) order;
* ``logits_unbiased``: ``(N, K)``, classifier logits without the bias, for the Inception Score
  (K = 1008).

:class:`~mhla_diffusion.eval.inception.InceptionV3Features` is the real network; the tests use a
small stand-in with the same interface. Any other ``nn.Module`` returning ``(N, D)`` features (what
torchmetrics' ``feature=`` takes) is wrapped by :class:`TensorFeatures`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

__all__ = [
    "FEATURE_KEYS",
    "FeatureExtractor",
    "TensorFeatures",
    "as_feature_extractor",
    "check_uint8_images",
    "exact_float32",
    "flatten_spatial",
    "spatial_features",
]

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


class TensorFeatures(FeatureExtractor):
    """A plain feature module (``forward(uint8 (N, 3, H, W)) -> (N, D)``, as torchmetrics' ``feature=``)
    behind the :class:`FeatureExtractor` interface: its output is every feature at once (``pool`` and
    ``logits_unbiased``; ``spatial`` as ``(N, 1, 1, D)``, so sFID equals FID).

    Images reach the module unchanged (uint8, as torchmetrics passes them with ``normalize=False``).
    ``D`` is the module's ``num_features`` attribute, else found by one forward of a random uint8 image
    of ``input_img_size`` (torchmetrics' rule). The module is kept in eval mode.
    """

    def __init__(self, module: nn.Module, input_img_size: tuple[int, int, int] = (3, 299, 299)) -> None:
        super().__init__()
        self.module = module
        self.name = type(module).__name__
        dim = getattr(module, "num_features", None)
        self.eval()
        if dim is None:
            dim = self._probe_dim(tuple(input_img_size))
        self.pool_dim = self.num_logits = int(dim)
        self.spatial_shape = (1, 1, int(dim))

    def _probe_dim(self, input_img_size: tuple[int, int, int]) -> int:
        image = torch.randint(0, 256, (1, *input_img_size), dtype=torch.uint8, device=self.device)
        try:
            with torch.inference_mode():
                out = self.module(image)
        except Exception as error:  # noqa: BLE001 -- any failure means the probe size does not fit the module
            raise ValueError(
                f"could not find the feature size of {self.name} by a forward of a {input_img_size} "
                f"uint8 image ({type(error).__name__}: {error}): give the module a `num_features` "
                "attribute or wrap it as TensorFeatures(module, input_img_size=(3, H, W))"
            ) from None
        return self._checked(out, 1).shape[1]

    def _checked(self, out: object, count: int) -> torch.Tensor:
        if not torch.is_tensor(out) or out.dim() != 2 or out.shape[0] != count:
            shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ValueError(f"feature module {self.name} must return an (N, D) tensor for N images, got {shape}")
        return out

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self._checked(self.module(images), images.shape[0])
        return {"pool": out, "spatial": out[:, None, None, :], "logits_unbiased": out}


def as_feature_extractor(network: nn.Module) -> FeatureExtractor:
    """``network`` itself when it is a :class:`FeatureExtractor`, else wrapped in :class:`TensorFeatures`."""
    if isinstance(network, FeatureExtractor):
        return network
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"the feature network must be a FeatureExtractor (e.g. InceptionV3Features) or an nn.Module "
            f"returning (N, D) features, got {type(network).__name__}"
        )
    return TensorFeatures(network)


def check_uint8_images(images: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``images`` is a uint8 tensor of shape ``(N, 3, H, W)``."""
    if not torch.is_tensor(images) or images.dtype != torch.uint8:
        raise ValueError(
            f"feature networks take uint8 images with values 0..255, got {getattr(images, 'dtype', type(images))}"
        )
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
