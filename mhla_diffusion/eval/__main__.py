"""``python -m mhla_diffusion.eval {eval,eval-ref,eval-sample} ...``: the evaluation commands as a module.

The form for launchers that take a module: ``accelerate launch -m mhla_diffusion.eval eval-sample ...``,
``torchrun --nproc_per_node 8 -m mhla_diffusion.eval eval-sample ...``. The commands themselves are
:mod:`mhla_diffusion.cli.evaluate` (also ``mhla eval``, ``mhla eval-ref``, ``mhla eval-sample``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..cli.arguments import CommandParser
from ..cli.evaluate import register


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mhla_diffusion.eval",
        description="ADM-style evaluation: FID, sFID, IS, precision/recall; sampling.",
    )
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser))
    args = parser.parse_args(argv)
    from ..loaders.loading import check_hub_models, hub_errors, model_names

    names = model_names(vars(args))
    try:
        with hub_errors(names):  # a model the hub cannot give: one line (as `mhla`)
            check_hub_models(names)
            return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
