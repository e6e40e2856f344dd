"""``mhla web``: the Gradio web demo (``python app.py`` runs the same).

The flags live with the web app (:func:`mhla_diffusion.web.config.add_arguments`, each with a
``MHLA_DEMO_*`` environment variable as its default); they are added when the command is used.
"""

from __future__ import annotations

import argparse

from .arguments import add_command

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(subparsers, "web", configure, help="start the Gradio web demo (MHLA vs softmax, side by side)")


def configure(parser: argparse.ArgumentParser) -> None:
    from ..web.app import DESCRIPTION
    from ..web.config import add_arguments

    parser.description = DESCRIPTION
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..web.app import run as serve_until_stopped

    return serve_until_stopped(args)
