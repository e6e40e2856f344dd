"""For the evaluation tests: a stand-in for the Inception feature network, and a randomly initialised
state dict of the real one's shape."""

from __future__ import annotations

from unittest import mock

import torch
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


def inception_template_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with the keys and shapes of torch-fidelity's Inception, randomly initialised.

    Built by constructing the real module with its weight loading switched off (nothing downloads).
    """
    from torch_fidelity import feature_extractor_inceptionv3 as module

    torch.manual_seed(seed)
    with (
        mock.patch.object(module, "load_state_dict_from_url", lambda *a, **k: {}),
        mock.patch.object(module.FeatureExtractorInceptionV3, "load_state_dict", lambda self, *a, **k: None),
    ):
        net = module.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    return {k: v.clone() for k, v in net.state_dict().items()}
