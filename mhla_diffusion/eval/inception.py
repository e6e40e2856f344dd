"""The TF-compatible "FID Inception" network (torch-fidelity's port), from a local weights file only.

The network is torch-fidelity's ``FeatureExtractorInceptionV3`` (the one torchmetrics also uses):
TF1 legacy bilinear resize to 299 x 299, ``(x - 128) / 128``, the 2015-12-05 Inception-v3 graph with
TF's pooling quirks. This module adds only what the ADM evaluator needs on top of it:

* ``spatial``: ``mixed_6/conv`` = the output of ``Mixed_6d.branch1x1`` (after BatchNorm and ReLU),
  first 7 channels, channels-last ``(N, 17, 17, 7)``, read with a forward hook;
* weights from a file the user supplies (argument or ``$MHLA_INCEPTION_WEIGHTS``), never a download:
  checked (a plain state dict with the right keys and shapes) and its SHA-256 logged (where the
  file comes from: :mod:`.inception_weights`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import warnings
from pathlib import Path
from typing import Mapping

import torch

from .features import FeatureExtractor, check_uint8_images, spatial_features
from .inception_weights import (
    INCEPTION_WEIGHTS_ENV,
    INCEPTION_WEIGHTS_NAMES,
    INCEPTION_WEIGHTS_URL,
    PUBLISHED_SHA256_PREFIX,
    resolve_inception_weights,
    sha256_of_file,
)
from .inception_weights import how_to_get_weights as _how_to_get_weights

__all__ = [
    "INCEPTION_WEIGHTS_ENV",
    "INCEPTION_WEIGHTS_NAMES",
    "INCEPTION_WEIGHTS_URL",
    "InceptionV3Features",
    "load_inception_state_dict",
    "resolve_inception_weights",
    "sha256_of_file",
]

logger = logging.getLogger(__name__)

SFID_CHANNELS = 7
_POOL_DIM, _NUM_LOGITS, _SPATIAL_SIDE = 2048, 1008, 17


def _unreadable_reason(data: bytes) -> str:
    """Why ``torch.load(weights_only=True)`` refused ``data``, in words (not torch's message)."""
    if data.startswith(b"PK\x03\x04"):
        return (
            f"it is a zip archive ({len(data)} bytes) that torch.load cannot read as a state dict of tensors "
            "(damaged or incomplete, or holding other Python objects)"
        )
    if data[:1] == b"\x80":
        return f"it is a pickle ({len(data)} bytes) that does not hold only tensors, or is damaged"
    return f"its {len(data)} bytes are neither a PyTorch zip archive nor a pickle"


def load_inception_state_dict(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], str]:
    """Read a weights file once: its state dict (CPU tensors) and the SHA-256 of exactly those bytes.

    Only plain tensors are unpickled (``weights_only=True``). Anything else is a ``ValueError`` that
    names the file and says what to obtain instead.
    """
    data = Path(path).read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    try:
        with warnings.catch_warnings():  # torch warns about odd pickle protocols of files it then refuses
            warnings.simplefilter("ignore", UserWarning)
            state_dict = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # torch raises several types (UnpicklingError, RuntimeError, EOFError, UnicodeDecodeError, ...)
        # torch's own text suggests weights_only=False (running the file's code): not repeated here.
        raise ValueError(
            f"{path} is not a PyTorch weights file: {_unreadable_reason(data)}. Expected the FID "
            f"Inception-v3 weights, a state dict of tensors saved with torch.save (.pth): "
            f"{_how_to_get_weights()}"
        ) from None
    if (
        not isinstance(state_dict, Mapping)
        or not state_dict
        or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state_dict.items())
    ):
        raise ValueError(
            f"{path} does not hold a plain state dict of tensors (got {type(state_dict).__name__}); "
            f"expected the FID Inception-v3 weights: {_how_to_get_weights()}"
        )
    return dict(state_dict), sha256


class InceptionV3Features(FeatureExtractor):
    """FID Inception-v3: uint8 ``(N, 3, H, W)`` -> pool ``(N, 2048)``, spatial ``(N, 17, 17, 7)``, logits ``(N, 1008)``.

    Args:
        weights: the weights file (``weights-inception-2015-12-05-6726825d.pth``); ``None`` reads
            ``$MHLA_INCEPTION_WEIGHTS``. Missing -> ``FileNotFoundError`` saying where to get it.
        device: where to run.
        internal_dtype: only ``"float32"`` (ADM's precision). torch-fidelity 0.4 accepts ``"float64"``
            but runs float32 anyway (its ``text_to_dtype`` maps float64 to float32), so it is refused here.
    """

    name = "inception-v3-fid (torch-fidelity port of the TF 2015-12-05 graph)"
    pool_dim = _POOL_DIM
    spatial_shape = (_SPATIAL_SIDE, _SPATIAL_SIDE, SFID_CHANNELS)
    num_logits = _NUM_LOGITS

    def __init__(
        self,
        weights: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        internal_dtype: str = "float32",
    ) -> None:
        super().__init__()
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        if internal_dtype != "float32":
            raise ValueError(
                f"internal_dtype must be 'float32', got {internal_dtype!r}: the Inception network runs in "
                "float32 only (torch-fidelity maps 'float64' to float32 internally; ADM uses float32)"
            )
        path = resolve_inception_weights(weights)
        state_dict, sha256 = load_inception_state_dict(path)
        logger.info("Inception weights %s sha256=%s", path, sha256)
        if not sha256.startswith(PUBLISHED_SHA256_PREFIX):
            logger.warning(
                "Inception weights %s: SHA-256 %s does not start with %s (the published file's name suffix); "
                "scores may not be comparable with published ones",
                path,
                sha256,
                PUBLISHED_SHA256_PREFIX,
            )
        # torch-fidelity loads from the path it is given; handing it the bytes just checked means the
        # file is read once and what was hashed is exactly what is loaded.
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        buffer.seek(0)
        try:
            net = FeatureExtractorInceptionV3(
                "inception-v3-compat",
                ["2048", "logits_unbiased"],
                feature_extractor_weights_path=buffer,
                feature_extractor_internal_dtype="float32",
            )
        except RuntimeError as error:  # load_state_dict: missing / unexpected keys, wrong shapes
            details = " ".join(str(error).split())
            details = details if len(details) <= 500 else details[:500] + " ..."
            raise ValueError(
                f"{path} is not the FID Inception-v3 weights file ({details}); expected: {_how_to_get_weights()}"
            ) from None
        self.net = net.to(device)
        self.weights_path = str(path)
        self.weights_sha256 = sha256
        self._mixed_6_conv: list[torch.Tensor] = []
        # mixed_6/conv:0 of the TF graph is Mixed_6d.branch1x1 (1x1 conv -> BN -> ReLU).
        self.net.Mixed_6d.branch1x1.register_forward_hook(lambda _m, _i, out: self._mixed_6_conv.append(out))
        self.eval()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 ``(N, 3, H, W)`` -> features.

        ``{"pool": (N, 2048), "spatial": (N, 17, 17, 7), "logits_unbiased": (N, 1008)}``.
        """
        check_uint8_images(images)
        self._mixed_6_conv.clear()
        pool, logits = self.net(images.to(self.device))
        spatial = spatial_features(self._mixed_6_conv.pop(), SFID_CHANNELS)
        return {"pool": pool.float(), "spatial": spatial.float(), "logits_unbiased": logits.float()}
