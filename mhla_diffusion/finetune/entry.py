"""The trainers' command line: options parsed and checked first, torch imported after.

``python finetune/train_wan.py``, ``accelerate launch finetune/train_wan.py`` and
``python -m mhla_diffusion.finetune.train_wan`` all end in :func:`main`. This module and
:mod:`.options` import no torch, so ``--help`` and every option error (an unknown name, a bad list, an
MHLAConfig field MHLAConfig refuses) come back at once; the trainer module, which imports torch and
Diffusers, is imported only for a run whose options passed.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any, Callable, Sequence

__all__ = ["main", "run_main"]

#: Errors that mean "fix your config / data", printed as one line instead of a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, ImportError)

#: Trainer name -> (options class name in :mod:`.options`, trainer module).
TRAINERS = {
    "wan": ("WanTrainOptions", "mhla_diffusion.finetune.train_wan"),
    "dit": ("DiTTrainOptions", "mhla_diffusion.finetune.train_dit"),
}


def main(trainer: str, argv: Sequence[str] | None = None) -> int:
    """Run trainer ``wan`` or ``dit`` on the command line ``argv`` (default ``sys.argv[1:]``): 0, or 2 after a
    one-line error."""
    from . import options

    class_name, module = TRAINERS[trainer]

    def train(args: Sequence[str] | None) -> Any:
        from ..loaders.loading import check_hub_model, hub_errors, model_names, source_kind

        checked = options.load_options(getattr(options, class_name), args)
        for model, option in checked.hub_models().items():  # before torch: a model the hub cannot give is one line
            if source_kind(model) == "hub":
                check_hub_model(model, option, checked.revision if option == "pretrained_model" else None)
        with hub_errors(model_names(checked.to_dict(), prefix="")):  # any later fetch (a component) too
            return importlib.import_module(module).train(checked)

    return run_main(train, argv)


_INTERRUPTED_OUTSIDE_STEPS = (
    "SIGINT: interrupted outside the training steps (while loading, caching or writing the final outputs); "
    "nothing was saved since the last checkpoint: --resume latest continues from it"
)


def under_accelerate_launch() -> bool:
    """Whether ``accelerate launch`` started this process (its launchers set these for every child)."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ and "ACCELERATE_DYNAMO_BACKEND" in os.environ


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
        # accelerate's launcher reports a child's non-zero exit with its own traceback, unless given -q
        hint = " (`accelerate launch -q` leaves out the launcher's own traceback)" if under_accelerate_launch() else ""
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    return 0
