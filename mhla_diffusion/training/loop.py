"""The plain training loop of the judges, the VAEs and ``mhla reproduce``: the optimizer step, a progress
bar, and a checkpoint every few steps from which a killed run continues where it stopped (the build's
in-stage resume).

The loop owns no randomness: ``loss_fn(step)`` must draw everything it needs from generators seeded by
``step`` (see :func:`step_generator`, :func:`epoch_batch`), so that model, optimizer and scheduler
states are all a checkpoint needs, and a resumed run equals an uninterrupted one bit for bit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from ..loaders.weight_files import read_checkpoint_file

__all__ = ["LoopLog", "LoopProgress", "epoch_batch", "run_loop", "step_generator"]

#: What a loop checkpoint may hold besides tensors and plain values: NumPy float scalars (learning rates
#: that an LR lambda computed with NumPy, kept in the schedule's state).
_NUMPY_FLOATS = [np.float64(0).__reduce__()[0], np.dtype, type(np.dtype(np.float64)), type(np.dtype(np.float32))]


@dataclass
class LoopProgress:
    """How a loop reports and protects its progress.

    ``checkpoint``: file the loop state is written to every ``every`` steps (``None``: no checkpoints);
    an existing file is resumed from. ``show``: a tqdm bar. ``on_step``: called with each finished step
    after its checkpoint (tests use it to interrupt a run).
    """

    checkpoint: Path | None = None
    every: int = 50
    show: bool = False
    on_step: Callable[[int], None] | None = None


@dataclass
class LoopLog:
    """What a loop measured: the recorded value of every step, and the seconds spent on the steps that
    count (over every attempt; the steps a killed attempt ran after its last checkpoint are not included)."""

    losses: list[float]
    seconds: float


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU torch generator that depends only on ``(seed, step, stream)``."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step, stream]).generate_state(1)[0]))


def epoch_batch(step: int, batch_size: int, num_items: int, seed: int) -> np.ndarray:
    """Item indices of batch ``step``: consecutive slices of seeded per-epoch permutations of ``num_items``
    (a batch may straddle two epochs), sorted. A pure function of its arguments."""
    start = step * batch_size
    picks = []
    while len(picks) < batch_size:
        epoch, offset = divmod(start + len(picks), num_items)
        order = np.random.default_rng([seed, epoch]).permutation(num_items)
        picks.extend(order[offset : offset + batch_size - len(picks)].tolist())
    return np.sort(np.asarray(picks, dtype=np.int64))


def _save(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # a kill while writing leaves the previous checkpoint intact


def run_loop(
    name: str,
    steps: int,
    loss_fn: Callable[[int], torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    progress: LoopProgress | None = None,
    clip_norm: float | None = None,
) -> LoopLog:
    """Minimise ``loss_fn(step)`` for ``step`` in ``0 .. steps - 1``: one optimizer step each (gradients
    clipped to ``clip_norm`` when given), then one ``schedule`` step.

    ``loss_fn`` returns the loss to minimise, or ``(loss, reported)`` to record another quantity (the VAE's
    reconstruction term, say). Model, optimizer and schedule make up the loop's state (its checkpoint).
    Returns the recorded value of every step (restored ones included) and the training seconds (:class:`LoopLog`).
    """
    progress = progress or LoopProgress()
    stateful = {"model": model, "optimizer": optimizer, "schedule": schedule}
    losses: list[float] = []
    start, seconds = 0, 0.0
    if progress.checkpoint is not None and progress.checkpoint.is_file():
        state = read_checkpoint_file(progress.checkpoint, safe_globals=_NUMPY_FLOATS)  # weights_only; damaged: one line
        if "seconds" not in state:
            raise ValueError(
                f"{progress.checkpoint} was written by an older version of this loop (no training time); "
                f"delete it to start this {name} run afresh"
            )
        if state["steps"] != steps or sorted(state["objects"]) != sorted(stateful):
            raise ValueError(
                f"{progress.checkpoint} belongs to another {name} run ({state['steps']} steps, parts "
                f"{sorted(state['objects'])}); delete it to start this one afresh"
            )
        for key, obj in stateful.items():
            obj.load_state_dict(state["objects"][key])
        start, losses, seconds = state["step"], list(state["losses"]), state["seconds"]
    bar = tqdm(total=steps, initial=start, desc=name, unit="step", disable=not progress.show, dynamic_ncols=True)
    for step in range(start, steps):
        began = time.perf_counter()
        loss = loss_fn(step)
        loss, reported = loss if isinstance(loss, tuple) else (loss, loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        schedule.step()
        losses.append(float(reported.item()))
        seconds += time.perf_counter() - began
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}", refresh=False)
        done = step + 1
        if progress.checkpoint is not None and (done % progress.every == 0 or done == steps):
            _save(
                progress.checkpoint,
                {
                    "step": done,
                    "steps": steps,
                    "losses": losses,
                    "seconds": seconds,
                    "objects": {key: obj.state_dict() for key, obj in stateful.items()},
                },
            )
        if progress.on_step is not None:
            progress.on_step(done)
    bar.close()
    return LoopLog(losses, seconds)
