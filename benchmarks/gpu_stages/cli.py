"""The command line of ``benchmarks/gpu_session.py``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from mhla_diffusion.benchmarks.bench import replace_marked_section

from .common import DEFAULT_BUDGET_S, DOC_SECTION, FORMAT
from .report import render_markdown, write_doc
from .runner import STAGE_NAMES, run_session, run_stage_here


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", nargs="?", type=Path, help="folder for gpu_session.json and gpu_session.md")
    p.add_argument(
        "--smoke", action="store_true", help="every stage at tiny sizes on the CPU (CUDA-only parts skipped)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for all stages (default {DEFAULT_BUDGET_S:.0f})",
    )
    p.add_argument("--stages", default=",".join(STAGE_NAMES), help=f"comma-separated subset of {','.join(STAGE_NAMES)}")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each stage in its own time-limited process (default: on CUDA, not with --smoke)",
    )
    p.add_argument(
        "--write-doc",
        type=Path,
        metavar="PAGE",
        help="replace the <!-- mhla-bench:cuda --> section of the Markdown page PAGE (docs/speed.md)",
    )
    p.add_argument("--report", type=Path, help="render a saved gpu_session.json (measures nothing)")
    p.add_argument("--stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)  # one stage, in an isolated process
    p.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)  # its time.time() deadline
    return p.parse_args(argv)


def _check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments as one line, or ``None``; nothing is written before this passes."""
    if args.report is None and args.out is None:
        return "give the output folder (OUT), or --report gpu_session.json"
    if args.report is not None and not args.report.is_file():
        return f"--report {args.report}: no such file; give the gpu_session.json a session wrote"
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        return f"output folder {args.out} is a file; give a folder (it is created when missing)"
    unknown = sorted(set(args.stages.split(",")) - set(STAGE_NAMES))
    if unknown:
        return f"--stages: unknown {','.join(unknown)}; choose from {','.join(STAGE_NAMES)}"
    if not args.budget_s > 0:
        return f"--budget-s {args.budget_s:g}: give a positive number of seconds"
    if args.write_doc is not None:
        if not args.write_doc.is_file():
            return f"--write-doc {args.write_doc}: no such file"
        try:
            replace_marked_section(args.write_doc.read_text(), DOC_SECTION, "")
        except ValueError as error:
            return f"--write-doc {args.write_doc}: {error}"
    if args.report is None and not args.smoke and not torch.cuda.is_available():
        return "no CUDA device here: run on a GPU, or with --smoke for the CPU check at tiny sizes"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage is not None:
        return run_stage_here(args.out, args.stage, args.smoke, args.deadline)
    problem = _check_args(args)
    if problem:
        print(f"gpu_session: {problem}", file=sys.stderr)
        return 2
    if args.report is not None:
        session = json.loads(args.report.read_text())
        if session.get("format") != FORMAT:
            print(
                f"gpu_session: --report {args.report} is not a GPU session result of this version "
                f"({FORMAT}); give the gpu_session.json this script wrote",
                file=sys.stderr,
            )
            return 2
    else:
        isolate = (not args.smoke) if args.isolate is None else args.isolate
        session = run_session(args.out, args.smoke, args.budget_s, tuple(args.stages.split(",")), isolate)
    if args.write_doc is not None:
        write_doc(args.write_doc, session)
    print(render_markdown(session))
    return 0
