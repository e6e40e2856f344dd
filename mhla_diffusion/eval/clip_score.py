"""CLIP score of videos: prompt-frame similarity averaged over each video's frames, then over videos.

Computed with torchmetrics' :class:`~torchmetrics.multimodal.clip_score.CLIPScore` (``100 * cos``,
clipped at 0 by torchmetrics) with a CLIP model read from a local folder the user supplies. torchmetrics
1.x accepts only known hub names (``openai/...``, ...) or a *callable* for ``model_name_or_path``, and
rejects a plain folder path; so the folder is handed over as a callable that loads it with
``from_pretrained(folder, local_files_only=True)``: nothing is downloaded.

transformers 5 returns a model output (projected embeddings in ``pooler_output``) from
``get_image_features`` / ``get_text_features`` where torchmetrics (1.9) expects a tensor;
:class:`_TensorFeatures` hands torchmetrics the tensor with either version.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

__all__ = ["VideoCLIPScore", "load_local_clip"]


class _TensorFeatures(torch.nn.Module):
    """A CLIPModel whose ``get_*_features`` return the projected embeddings as a tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    @staticmethod
    def _tensor(output) -> torch.Tensor:
        return output if torch.is_tensor(output) else output.pooler_output

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_text_features(*args, **kwargs))


def load_local_clip(folder: str | os.PathLike):
    """``(CLIPModel, CLIPProcessor)`` from a local folder, offline (the model wrapped for torchmetrics)."""
    from transformers import CLIPModel, CLIPProcessor

    folder = str(folder)
    try:
        model = CLIPModel.from_pretrained(folder, local_files_only=True)
        processor = CLIPProcessor.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load a CLIP model and processor from {folder}: {error}") from None
    return _TensorFeatures(model.eval()), processor


class VideoCLIPScore:
    """Per-video CLIP score: uint8 frames ``(F, H, W, 3)`` + prompt -> mean over frames."""

    def __init__(self, folder: str | os.PathLike, device: str | torch.device = "cpu", frame_batch: int = 32):
        from torchmetrics.multimodal.clip_score import CLIPScore

        self.folder = str(Path(folder))
        self.metric = CLIPScore(model_name_or_path=lambda: load_local_clip(self.folder)).to(device)
        self.device, self.frame_batch = torch.device(device), frame_batch

    @torch.inference_mode()
    def score(self, frames: np.ndarray, prompt: str) -> float:
        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 (F, H, W, 3), got {frames.dtype} {frames.shape}")
        self.metric.reset()
        tensor = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).to(self.device)
        for start in range(0, len(tensor), self.frame_batch):
            chunk = tensor[start : start + self.frame_batch]
            self.metric.update(list(chunk), [prompt] * len(chunk))
        return float(self.metric.compute())

    def __call__(self, videos: Iterable[np.ndarray], prompts: Sequence[str]) -> dict:
        """``{"clip_score": mean over videos, "per_video": [...]}``."""
        per_video = [self.score(frames, prompt) for frames, prompt in zip(videos, prompts)]
        if not per_video:
            raise ValueError("the CLIP score needs at least one video")
        return {"clip_score": float(np.mean(per_video)), "per_video": per_video}

    def info(self) -> dict:
        return {
            "name": "clip",
            "model_folder": self.folder,
            "definition": "torchmetrics CLIPScore (100 * cosine, clipped at 0) over each video's frames, "
            "averaged over frames, then over videos",
        }
