"""Frechet Video Distance: I3D features of 16-frame clips, then the Frechet distance shared with FID.

The network is the TorchScript I3D file users supply (:mod:`.video_weights`: ``i3d_torchscript.pt``,
StyleGAN-V's port of the TensorFlow FVD's Kinetics-400 I3D), loaded with ``torch.jit.load`` and
called with StyleGAN-V's keyword interface ``model(x, rescale=..., resize=..., return_features=True)``
(``return_features=True``: the raw features before the softmax).

Preprocessing (assumed; the project's facts file has no FVD entry, so this follows the widely used
``common_metrics_on_video_quality`` / ``content-debiased-fvd`` preprocessing for that file):

* the first :data:`FVD_FRAMES` = 16 frames of each video (shorter videos are an error);
* each frame resized so its shorter side is 224 (bilinear, ``align_corners=False``), then a centre
  crop of 224 x 224;
* values ``uint8 / 127.5 - 1`` in ``[-1, 1]``, shape ``(N, 3, T, H, W)``, and the network called with
  ``rescale=False, resize=False`` (it neither rescales nor resizes again).

StyleGAN-V's own ``compute_fvd`` instead hands the network 0..255 values with ``rescale=True,
resize=True`` and lets it do both inside; that should give nearly the same features (its internal
resize may differ), but the numbers are not guaranteed identical. The feature size is whatever the
network returns (reported as 400 by some code bases, 1024 by others: not verified here).
Statistics: mean and unbiased covariance in float64 (:class:`~.frechet.RunningGaussian`), distance
:func:`~.frechet.frechet_distance`. A reference ``.npz`` holds ``mu``, ``sigma`` and the settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from .frechet import GaussianStats, RunningGaussian
from .inception_weights import sha256_of_file

__all__ = [
    "FVD_FRAMES",
    "FVD_SIZE",
    "I3DFeatures",
    "fvd_stats",
    "load_fvd_reference",
    "preprocess_clips",
    "save_fvd_reference",
]

FVD_FRAMES = 16
FVD_SIZE = 224
_KIND = "fvd-i3d"


def preprocess_clips(
    clips: np.ndarray | torch.Tensor, num_frames: int = FVD_FRAMES, size: int = FVD_SIZE
) -> torch.Tensor:
    """uint8 clips ``(N, F, H, W, 3)`` -> float ``(N, 3, num_frames, size, size)`` in ``[-1, 1]``."""
    clips = torch.as_tensor(np.asarray(clips)) if not torch.is_tensor(clips) else clips
    if clips.dtype != torch.uint8 or clips.dim() != 5 or clips.shape[-1] != 3:
        raise ValueError(f"clips must be uint8 (N, F, H, W, 3), got {clips.dtype} {tuple(clips.shape)}")
    n, f, h, w, _ = clips.shape
    if f < num_frames:
        raise ValueError(f"FVD takes clips of {num_frames} frames; got clips of {f}")
    frames = clips[:, :num_frames].reshape(n * num_frames, h, w, 3).permute(0, 3, 1, 2).float()
    scale = size / min(h, w)
    target = (max(size, round(h * scale)), max(size, round(w * scale)))
    if target != (h, w):
        frames = F.interpolate(frames, size=target, mode="bilinear", align_corners=False)
    top, left = (target[0] - size) // 2, (target[1] - size) // 2
    frames = frames[:, :, top : top + size, left : left + size]
    frames = frames / 127.5 - 1.0
    return frames.reshape(n, num_frames, 3, size, size).permute(0, 2, 1, 3, 4).contiguous()


class I3DFeatures:
    """The TorchScript I3D: uint8 clips ``(N, F, H, W, 3)`` -> features ``(N, D)`` float64."""

    name = "i3d-torchscript"

    def __init__(
        self,
        weights: str | os.PathLike,
        device: str | torch.device = "cpu",
        num_frames: int = FVD_FRAMES,
        size: int = FVD_SIZE,
    ):
        self.weights_path = str(weights)
        try:
            self.model = torch.jit.load(self.weights_path, map_location=device).eval()
        except (RuntimeError, ValueError) as error:
            raise ValueError(
                f"{weights} is not a TorchScript file (expected StyleGAN-V's i3d_torchscript.pt): {error}"
            ) from None
        self.weights_sha256 = sha256_of_file(self.weights_path)
        self.device, self.num_frames, self.size = torch.device(device), num_frames, size

    @torch.inference_mode()
    def __call__(self, clips: np.ndarray) -> np.ndarray:
        x = preprocess_clips(clips, self.num_frames, self.size).to(self.device)
        features = self.model(x, rescale=False, resize=False, return_features=True)
        if not torch.is_tensor(features) or features.dim() != 2 or features.shape[0] != x.shape[0]:
            raise ValueError(
                f"{self.weights_path} returned {getattr(features, 'shape', type(features))}, not features "
                f"(N, D) for {x.shape[0]} clips: is it the FVD I3D TorchScript file?"
            )
        return features.double().cpu().numpy()

    def info(self) -> dict:
        return {
            "name": self.name,
            "weights_path": self.weights_path,
            "weights_sha256": self.weights_sha256,
            "num_frames": self.num_frames,
            "size": self.size,
            "call": "model(x, rescale=False, resize=False, return_features=True), x (N, 3, T, H, W) in [-1, 1]",
        }


def fvd_stats(
    clips: Iterable[np.ndarray], extractor: Callable[[np.ndarray], np.ndarray], batch_size: int = 8
) -> GaussianStats:
    """Mean and covariance of the features of ``clips`` (uint8 ``(F, H, W, 3)`` each, any count >= 2)."""
    running, batch = RunningGaussian(), []
    for clip in clips:
        batch.append(np.asarray(clip)[: getattr(extractor, "num_frames", FVD_FRAMES)])
        if len(batch) == batch_size:
            running.update(extractor(np.stack(batch)))
            batch = []
    if batch:
        running.update(extractor(np.stack(batch)))
    if running.count < 2:
        raise ValueError(f"FVD needs at least 2 videos per set, got {running.count}")
    return running.stats()


def save_fvd_reference(stats: GaussianStats, path: str | os.PathLike, info: dict, overwrite: bool = False) -> Path:
    """Write ``mu``, ``sigma``, ``count`` and the preprocessing settings to an ``.npz``."""
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"{path}: the FVD reference file must end in .npz")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; choose another path or pass --overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        mu=stats.mu,
        sigma=stats.sigma,
        count=np.int64(stats.count or 0),
        kind=np.str_(_KIND),
        num_frames=np.int64(info["num_frames"]),
        size=np.int64(info["size"]),
        weights_sha256=np.str_(info.get("weights_sha256") or ""),
    )
    return path


def load_fvd_reference(path: str | os.PathLike, info: dict | None = None) -> GaussianStats:
    """``mu``/``sigma`` of an FVD reference ``.npz``; an error if its settings differ from ``info``'s."""
    with np.load(path, allow_pickle=False) as data:
        if "mu" not in data or "sigma" not in data:
            raise ValueError(f"{path} has no mu/sigma: write an FVD reference with `mhla eval-video ... --save-ref`")
        kind = str(data["kind"]) if "kind" in data else None
        if kind is not None and kind != _KIND:
            raise ValueError(f"{path} holds {kind} statistics, not FVD I3D statistics")
        if info is not None:
            for key in ("num_frames", "size"):
                if key in data and int(data[key]) != int(info[key]):
                    raise ValueError(f"{path} was computed with {key}={int(data[key])}, this run uses {info[key]}")
        count = int(data["count"]) if "count" in data else None
        return GaussianStats(data["mu"], data["sigma"], count=count or None)
