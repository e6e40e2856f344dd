"""Stopping a run cleanly on SIGINT or SIGTERM (Ctrl-C, a preemptible cluster's notice).

The first signal asks the run to stop: the current optimizer step finishes, a checkpoint is written and
the trainer exits non-zero with ``saved step-N; resume with --resume latest``. A second SIGINT stops at
once (nothing is saved after the last checkpoint); further SIGTERMs are ignored, so a launcher that
forwards Ctrl-C as SIGTERM to a worker that also got the SIGINT does not cut the save short.

With several processes the request is all-reduced after every step, so every process stops at the
same step and saves its share of the checkpoint together.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import torch

__all__ = ["StopRequest", "TrainingInterrupted"]

logger = logging.getLogger(__name__)


class TrainingInterrupted(KeyboardInterrupt):
    """The run stopped on a signal; ``checkpoint`` is where it can resume from (``None``: nothing saved).

    A ``KeyboardInterrupt``, so no ``except Exception`` on the way up swallows it."""

    def __init__(self, signum: int, step: int | None, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        if checkpoint is not None:
            message = f"{name}: saved {checkpoint.name}; resume with --resume latest"
        elif step is not None:
            message = (
                f"{name}: stopped at once after step {step}; resume with --resume latest (from the last checkpoint)"
            )
        else:
            message = f"{name}: stopped before the first step; nothing was saved"
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """Context manager that turns SIGINT / SIGTERM into a request the training loop reads after each step.

    ``requested(accelerator)`` is the signal number every process agrees on (the largest asked for by any
    process), or 0. Outside the main thread (where Python cannot install handlers) it never asks to stop.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum = 0
        self.step: int | None = None  # the last completed step, for a second Ctrl-C's message
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if not self.signum:
            self.signum = signum
            logger.warning(
                "%s received: finishing this step and saving a checkpoint (Ctrl-C again to stop at once)",
                signal.Signals(signum).name,
            )
        elif signum == signal.SIGINT:
            raise TrainingInterrupted(signum, self.step, None)

    def requested(self, accelerator) -> int:
        if accelerator.num_processes == 1:
            return self.signum
        flag = torch.tensor([self.signum], device=accelerator.device)
        return int(accelerator.gather(flag).max().item())
