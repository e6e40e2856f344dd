"""``mhla reproduce``: train the same DiT from scratch with each attention at several token counts and
seeds, and say whether the attentions can be told apart (:mod:`mhla_diffusion.embedded.attention_experiment`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import add_command, dataclass_field_names

__all__ = ["DEFAULT_OUTPUT", "register"]

DEFAULT_OUTPUT = Path("runs/reproduce")


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers, "reproduce", configure,
        help="train softmax, linear and MHLA DiTs from scratch at several token counts and compare them",
        description="Train the same class-to-image DiT (digits, pixel space) from random initialisation with softmax, "
        "global linear attention, MHLA, MHLA with LePE and gate, and the released DiT-MHLA setting, at each token count "
        "and seed; score every run with the embedded judge (FID, precision, recall, accuracy) and measure the effective "
        "rank of every layer's attention output. Writes report.json, table.md and fid-vs-tokens.png to --output.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                   help=f"runs, checkpoints and results; a rerun resumes a killed experiment inside the run it was in "
                   f"(default {DEFAULT_OUTPUT})")
    p.add_argument("--smoke", action="store_true", help="a tiny model and two steps per run: checks the whole chain")
    p.add_argument("--figure", type=Path, default=None,
                   help="also copy the FID-vs-tokens plot there (the one docs/reproduce.md shows: docs/reproduce-fid-vs-tokens.png)")
    p.add_argument("--vae", type=Path, default=None,
                   help="the digits AutoencoderKL folder to work in (default: the embedded digits VAE)")
    p.add_argument("--judge", type=Path, default=None,
                   help="the image judge folder that scores the runs (default: the embedded digits judge)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="change one setting, e.g. --set token_counts=256,1024,4096 --set steps=1200,1200,400 "
                   "(repeatable). The settings (the fields of mhla_diffusion.embedded.attention_experiment."
                   "ExperimentSettings): "
                   + ", ".join(dataclass_field_names("mhla_diffusion.embedded.attention_experiment", "ExperimentSettings")))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from ..ops.cpu_memory import retain_freed_memory
    from ..embedded.attention_experiment import ExperimentSettings, run_experiment
    from ..embedded.build import settings_with

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = settings_with(ExperimentSettings.smoke() if args.smoke else ExperimentSettings(), args.overrides)
    settings.check()
    retain_freed_memory()
    report = run_experiment(args.output, settings, figure=args.figure, vae=args.vae, judge=args.judge)
    print((args.output / "table.md").read_text())
    print(f"report: {args.output / 'report.json'}; plot: {args.output / 'fid-vs-tokens.png'}; "
          f"{report['seconds']:.0f} s in all (every run, every attempt)")
    return 0
