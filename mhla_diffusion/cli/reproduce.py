"""``mhla reproduce``: the attentions compared where their differences can stand above their own noise
(:mod:`mhla_diffusion.reproduce.experiment`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import add_command, add_settings_option, check_settings

__all__ = ["DEFAULT_OUTPUT", "register"]

DEFAULT_OUTPUT = Path("runs/reproduce")


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "reproduce",
        configure,
        help="compare softmax, global linear attention and MHLA: operator fits, attention rank, a paired generative "
        "check",
        description="Part A: one attention layer fitted to a local softmax teacher, to a non-local teacher whose "
        "attention matrix has rank 64 (both drawn anew per seed) and to associative recall with 64 pairs, by "
        "controls that separate locality from rank (MHLA's blocks on permuted tokens; linear attention with heads "
        "as wide as MHLA's rank bound; uniform, shuffled and local mixing frozen; MHLA learned; LePE with and "
        "without MHLA; softmax), with blocks and batch size fixed across token counts and recall's learning rates "
        "from a sweep on a held-out seed, over 5 seeds: held-out error with 95 % intervals, and the rank of each "
        "N x N attention matrix before and after training beside its bound. Part B: a small DiT denoiser trained "
        "from scratch on mirror-symmetric 1,024-token images with linear attention, MHLA and linear + LePE (softmax "
        "too with --set part_b_arms=softmax,linear,mhla,linear-lepe), over 4 "
        "seeds: held-out denoising loss and sample asymmetry, paired by seed. Comparisons are Holm-corrected "
        "within named families, with equivalence against margins fixed before the run. Planned to fit 90 minutes "
        "on 2 CPU cores with the machine to itself; resumable. Writes report.json (after every unit), table.md, "
        "reading.md and three figures to --output.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"runs and results; a rerun skips the finished units and resumes the one it was in "
        f"(default {DEFAULT_OUTPUT})",
    )
    p.add_argument("--smoke", action="store_true", help="tiny grids and a few steps per run: checks the whole chain")
    p.add_argument(
        "--budget",
        action="store_true",
        help="time a few training steps of every arm at every token count (CPU seconds on one thread), print "
        "the projected minutes of the whole run and the machine's load while timing, and exit (writes nothing); "
        "other work on the machine slows the steps and inflates the projection",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="recompute the summary, table, reading and figures in --output from its complete report.json, rewrite "
        "README.md's 'Attentions compared' section and docs/reproduce.md (in the current folder, the repository "
        "root) from it, and exit (trains nothing)",
    )
    add_settings_option(
        p,
        "mhla_diffusion.reproduce.experiment",
        "ExperimentSettings",
        "setting",
        "--set part_a_seeds=0,1,2 --set part_b_steps=300",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    check_settings(args.overrides, "mhla_diffusion.reproduce.experiment", "ExperimentSettings")
    from ..reproduce.experiment import ExperimentSettings, budget_markdown, estimate_budget, run_experiment
    from ..utils.options import settings_with

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.docs:
        from ..reproduce.docs import write_docs

        path = args.output / "report.json"
        if not path.is_file():
            raise ValueError(f"mhla reproduce --docs: no report at {path}; run the experiment or name its --output")
        from ..reproduce.experiment import rewrite_outputs

        report = rewrite_outputs(args.output)
        for written in write_docs(report, Path.cwd()):
            print(f"wrote {written}")
        return 0
    settings = settings_with(ExperimentSettings.smoke() if args.smoke else ExperimentSettings(), args.overrides)
    settings.check()
    if args.budget:
        print(budget_markdown(estimate_budget(settings)))
        return 0
    report = run_experiment(args.output, settings)
    print((args.output / "table.md").read_text())
    print((args.output / "reading.md").read_text())
    print(
        f"report: {args.output / 'report.json'}; figures and table beside it; {report['seconds']:.0f} s in all "
        "(every unit, every attempt)"
    )
    return 0
