"""The judges as feature networks of ``mhla_diffusion.eval`` (FID, sFID, IS, precision/recall).

The evaluator's interface (:class:`~mhla_diffusion.eval.FeatureExtractor`) takes images, uint8
``(N, 3, H, W)``. A clip is given to it as a *filmstrip*: its ``F`` frames stacked top to bottom
into one ``(F * H, W)`` image (:func:`clips_to_filmstrips`), so ``ArrayImages``, folders of PNGs and
``.npz`` files carry clips unchanged. One clip gives one feature vector: the video judge's pool
features of the whole clip (its penultimate layer).

Features (``width``/``embed_dim`` are the judge's settings):

* video: ``pool`` ``(N, embed_dim)``; ``spatial`` ``(N, 4, 4, SPATIAL_CHANNELS)``, the last conv map
  averaged over time; ``logits_unbiased`` ``(N, 11)``, the shape, colour and direction heads' logits
  without bias, concatenated in :data:`~.moving_shapes.ATTRIBUTES` order;
* image: ``pool`` ``(N, embed_dim)``; ``spatial`` ``(N, S/4, S/4, SPATIAL_CHANNELS)``; ``logits_unbiased``
  ``(N, num_classes)``. Images of another size are resized (bilinear, antialiased) to the judge's ``S``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mhla_diffusion.eval.features import FeatureExtractor, check_uint8_images, spatial_features

from ..worlds.moving_shapes import ATTRIBUTES
from .image_judge import ImageJudge
from .video_judge import VideoJudge

__all__ = [
    "SPATIAL_CHANNELS",
    "ImageJudgeFeatures",
    "VideoJudgeFeatures",
    "clips_to_filmstrips",
    "filmstrips_to_clips",
    "judge_features",
]

#: Channels of the last conv map kept for sFID (as Inception keeps 7 of mixed_6/conv's 768).
SPATIAL_CHANNELS = 8


def clips_to_filmstrips(clips: np.ndarray) -> np.ndarray:
    """uint8 clips ``(N, F, H, W, 3)`` -> filmstrip images ``(N, F * H, W, 3)`` (frames top to bottom)."""
    clips = np.asarray(clips)
    if clips.dtype != np.uint8 or clips.ndim != 5 or clips.shape[-1] != 3:
        raise ValueError(f"clips must be uint8 (N, F, H, W, 3), got {clips.dtype} {clips.shape}")
    n, f, h, w, _ = clips.shape
    return clips.reshape(n, f * h, w, 3)


def filmstrips_to_clips(images: np.ndarray, num_frames: int) -> np.ndarray:
    """Inverse of :func:`clips_to_filmstrips`: ``(N, F * H, W, 3)`` -> ``(N, F, H, W, 3)``."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or num_frames < 1 or images.shape[1] % num_frames:
        raise ValueError(f"filmstrips must be (N, {num_frames} * H, W, 3), got {images.shape}")
    n, fh, w, _ = images.shape
    return images.reshape(n, num_frames, fh // num_frames, w, 3)


def _unbiased(head: torch.nn.Linear, pooled: torch.Tensor) -> torch.Tensor:
    return pooled @ head.weight.T


class VideoJudgeFeatures(FeatureExtractor):
    """A :class:`VideoJudge` behind the evaluator's interface; input: filmstrips uint8 ``(N, 3, F * H, W)``."""

    name = "video-judge"

    def __init__(self, judge: VideoJudge, weights_path: str | None = None, weights_sha256: str | None = None):
        super().__init__()
        self.judge = judge.requires_grad_(False)
        cfg = judge.config
        cells = cfg["frame_size"] // 16
        self.pool_dim = cfg["embed_dim"]
        self.spatial_shape = (cells, cells, SPATIAL_CHANNELS)
        self.num_logits = sum(len(values) for values in ATTRIBUTES.values())
        self.weights_path, self.weights_sha256 = weights_path, weights_sha256
        self.eval()

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        check_uint8_images(images)
        f, size = self.judge.config["num_frames"], self.judge.config["frame_size"]
        if tuple(images.shape[2:]) != (f * size, size):
            raise ValueError(
                f"the video judge takes filmstrips of {f} frames of {size}x{size}, i.e. images "
                f"(N, 3, {f * size}, {size}); got {tuple(images.shape)} (see clips_to_filmstrips)"
            )
        n = images.shape[0]
        clips = images.to(self.device).reshape(n, 3, f, size, size).float() / 127.5 - 1.0
        fmap = self.judge.feature_map(clips)
        pooled = self.judge.embed(fmap)
        logits = torch.cat([_unbiased(self.judge.heads[name], pooled) for name in ATTRIBUTES], dim=1)
        return {"pool": pooled, "spatial": spatial_features(fmap.mean(2), SPATIAL_CHANNELS), "logits_unbiased": logits}


class ImageJudgeFeatures(FeatureExtractor):
    """An :class:`ImageJudge` behind the evaluator's interface; input: uint8 ``(N, 3, H, W)``, any size."""

    name = "image-judge"

    def __init__(self, judge: ImageJudge, weights_path: str | None = None, weights_sha256: str | None = None):
        super().__init__()
        self.judge = judge.requires_grad_(False)
        cfg = judge.config
        self.pool_dim = cfg["embed_dim"]
        self.spatial_shape = (cfg["image_size"] // 4, cfg["image_size"] // 4, SPATIAL_CHANNELS)
        self.num_logits = cfg["num_classes"]
        self.weights_path, self.weights_sha256 = weights_path, weights_sha256
        self.eval()

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        check_uint8_images(images)
        size = self.judge.config["image_size"]
        x = images.to(self.device).float()
        if tuple(x.shape[2:]) != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        fmap = self.judge.feature_map(x / 127.5 - 1.0)
        pooled = self.judge.embed(fmap)
        return {
            "pool": pooled,
            "spatial": spatial_features(fmap, SPATIAL_CHANNELS),
            "logits_unbiased": _unbiased(self.judge.head, pooled),
        }


def judge_features(
    judge: VideoJudge | ImageJudge, weights_path: str | None = None, weights_sha256: str | None = None
) -> VideoJudgeFeatures | ImageJudgeFeatures:
    """The feature network of either judge."""
    if isinstance(judge, VideoJudge):
        return VideoJudgeFeatures(judge, weights_path, weights_sha256)
    if isinstance(judge, ImageJudge):
        return ImageJudgeFeatures(judge, weights_path, weights_sha256)
    raise ValueError(f"expected a VideoJudge or ImageJudge, got {type(judge).__name__}")
