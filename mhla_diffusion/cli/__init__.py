"""The ``mhla`` command: one entry point, one subcommand per job, one module per group of subcommands.

    mhla convert --tiny wan                       # convert a tiny Wan model, print what changed
    mhla convert --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --layers hybrid \\
        --target-size 81x480x832 --output mhla_init/
    mhla text-to-video --model ... --mhla-weights mhla_init/ --prompt "a cat surfing"
    mhla image-to-video --model Wan-AI/Wan2.1-I2V-14B-480P-Diffusers --mhla-weights ... --image cat.png --prompt "..."
    mhla class-to-image --model facebook/DiT-XL-2-256 --mhla-weights ... --class 207
    mhla generate --model SKYREELS_HUNYUAN_LTX_COGVIDEOX_SANA_OR_FLUX_PIPELINE --mhla-weights ... --prompt "..."
    mhla import-wan released.safetensors --output wan_mhla_transformer/
    mhla import-dit DiT-XL-2-256x256.pt --output dit_transformer/   # or a released DiT-MHLA checkpoint
    mhla eval / eval-ref / eval-sample            # ADM-style FID, sFID, IS, precision/recall
    mhla eval-video                               # FVD, CLIP score, embedded-judge metrics of videos
    mhla bench                                    # MHLA beside softmax and linear attention
    mhla build-embedded                           # train the embedded demonstration models
    mhla reproduce                                # softmax vs linear vs MHLA: operator fits, rank, paired DiT check
    mhla web                                      # Gradio web demo on 127.0.0.1 (pip install .[demo])
    mhla --version

:mod:`.convert`, :mod:`.generate` (text-to-video, image-to-video, class-to-image), :mod:`.generate_family`
(generate, with the other families' stock pipelines), :mod:`.import_wan`,
:mod:`.import_dit`, :mod:`.evaluate`, :mod:`.evaluate_video`, :mod:`.bench`, :mod:`.build_embedded`,
:mod:`.reproduce` and :mod:`.web` each parse their command and print its results; :mod:`.arguments` holds what
they parse alike. They
import only the standard library at module level: a command's arguments are added when it is used,
and torch, Diffusers and the library load inside the command's ``run`` function, after parsing, so
``mhla --help`` and argument errors are immediate.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .. import __version__
from . import (
    bench,
    build_embedded,
    convert,
    evaluate,
    evaluate_video,
    generate,
    generate_family,
    import_dit,
    import_wan,
    reproduce,
    web,
)
from .arguments import CommandParser

__all__ = ["build_parser", "main"]

#: In the order ``mhla --help`` lists them.
COMMAND_MODULES = (
    convert,
    generate,
    generate_family,
    import_wan,
    import_dit,
    evaluate,
    evaluate_video,
    bench,
    build_embedded,
    reproduce,
    web,
)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="mhla", description="Multi-Head Linear Attention for Diffusers (Wan2.1, Wan2.2, DiT).")
    parser.add_argument("--version", action="version", version=f"mhla-diffusion {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..loaders.loading import check_hub_models, hub_errors, model_names
    from ..utils.options import zero_flags

    command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    if off := zero_flags(command, args):  # a 0 that switches something off is said once, before the run
        print(f"mhla {args.command}: off (set to 0): {'; '.join(off)}", file=sys.stderr)

    names = model_names(vars(args))  # the models the command loads, by the option that names them
    try:
        with hub_errors(names):  # a model the hub cannot give: one line naming it, why and what to do
            check_hub_models(names)
            return args.func(args)
    except (ValueError, TypeError, OSError) as error:  # bad input: a readable line, not a traceback
        print(f"mhla {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a generation (which says itself what it kept): one line
        print(f"mhla {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
