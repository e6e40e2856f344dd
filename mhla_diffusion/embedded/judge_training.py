"""The optimisation loop both judges share: AdamW with cosine decay, optional running-loss log."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
from torch import nn

__all__ = ["fit_judge"]


def fit_judge(judge: nn.Module, steps: int, lr: float, batch_loss: Callable[[int], torch.Tensor],
              name: str, log_every: int = 0) -> nn.Module:
    """Train ``judge`` for ``steps`` steps on ``batch_loss(step)``; returns it in eval mode.

    ``log_every > 0`` prints the running loss every that many steps, labelled with ``name``.
    """
    optimizer = torch.optim.AdamW(judge.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + np.cos(np.pi * s / steps)))
    started, running = time.perf_counter(), 0.0
    judge.train()
    for step in range(steps):
        loss = batch_loss(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        running += loss.item()
        if log_every and (step + 1) % log_every == 0:
            print(f"{name} step {step + 1}/{steps} loss {running / log_every:.4f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            running = 0.0
    return judge.eval()
