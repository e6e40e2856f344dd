"""Shared ``main`` of the trainer scripts: logging on the main process, clean errors for bad input."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Sequence

__all__ = ["run_main"]

#: Errors that mean "fix your config / data", printed as one line instead of a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, ImportError)

_INTERRUPTED_OUTSIDE_STEPS = (
    "SIGINT: interrupted outside the training steps (while loading, caching or writing the final outputs); "
    "nothing was saved since the last checkpoint: --resume latest continues from it"
)


def run_main(train: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None) -> int:
    """Configure logging, run ``train(argv)``; return 0, or 2 after printing a user error."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "urllib3", "filelock", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        train(argv)
    except SystemExit:
        raise
    except KeyboardInterrupt as stop:  # a TrainingInterrupted from the loop, or Ctrl-C outside the steps
        if rank == 0:
            print(str(stop) or _INTERRUPTED_OUTSIDE_STEPS, file=sys.stderr)
        return getattr(stop, "exit_code", 130)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
