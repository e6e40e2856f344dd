"""The optimisation loop both judges share: AdamW with cosine decay, in :func:`run_loop` (progress bar, resumable)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from ...training.loop import LoopProgress, run_loop

__all__ = ["fit_judge"]


def fit_judge(
    judge: nn.Module,
    steps: int,
    lr: float,
    batch_loss: Callable[[int], torch.Tensor],
    name: str,
    progress: LoopProgress | None = None,
) -> nn.Module:
    """Train ``judge`` for ``steps`` steps on ``batch_loss(step)`` (a pure function of ``step`` and the
    judge); returns it in eval mode. ``progress``: bar and checkpoint (:class:`LoopProgress`)."""
    optimizer = torch.optim.AdamW(judge.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + np.cos(np.pi * s / steps)))

    judge.train()
    run_loop(name, steps, batch_loss, judge, optimizer, schedule, progress)
    return judge.eval()
