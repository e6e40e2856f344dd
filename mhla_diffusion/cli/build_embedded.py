"""``mhla build-embedded``: train the embedded demonstration models and the reproduction table from scratch.

The build itself is :mod:`mhla_diffusion.embedded.builds.build`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..embedded.locations import EMBEDDED_ROOT
from .arguments import add_command, add_settings_option, check_settings, dataclass_field_names

__all__ = ["DEFAULT_STREAM_WORK_DIR", "DEFAULT_WORK_DIR", "register"]

DEFAULT_WORK_DIR = Path("runs/build-embedded")
DEFAULT_STREAM_WORK_DIR = Path("runs/build-embedded-stream")  # --stream's, unless --work-dir is given


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "build-embedded",
        configure,
        help="train the embedded demonstration models and the reproduction table from scratch",
        description="Train the small moving-shapes (Wan architecture) and digits (DiT architecture) models, their "
        "MHLA / hybrid / linear conversions and judges, score them, and write the models to --output.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="intermediate files and checkpoints; a rerun resumes a killed build inside the stage it "
        f"was in (default {DEFAULT_WORK_DIR}; with --stream {DEFAULT_STREAM_WORK_DIR})",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=EMBEDDED_ROOT,
        help="where the final models go (default: the package's mhla_diffusion/embedded/models)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace models already in --output")
    p.add_argument("--smoke", action="store_true", help="a few steps per stage: checks the whole chain in minutes")
    p.add_argument("--no-export", action="store_true", help="stop after the evaluation; write nothing to --output")
    p.add_argument(
        "--figure",
        type=Path,
        default=None,
        help="also copy the MHLA / softmax side-by-side figure there (the README's: docs/embedded-side-by-side.png)",
    )
    p.add_argument(
        "--from-build",
        type=Path,
        default=None,
        metavar="DIR",
        help="start a new --work-dir from the judges, VAEs and teachers of the build exported to DIR (its "
        "build_report.json and models, e.g. mhla_diffusion/embedded/models): only the data, the students "
        "and the evaluation run (for new student or evaluation settings)",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="build the streaming long-video models instead (shapes-long-mhla and its block-causal softmax "
        "teacher shapes-long-softmax, fine-tuned from the softmax teacher of --from-build, default the package's), "
        "the long-video judge and the long-video report; resumable like the main build",
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="with --stream: train nothing; read the streaming models of the pilot in --work-dir at 2x and 8x its "
        "training length and with oracle context (the true first chunks given), print the table and write it to "
        "<work-dir>/diagnosis",
    )
    add_settings_option(
        p,
        "mhla_diffusion.embedded.builds.build_settings",
        "BuildSettings",
        "build setting",
        "--set video_teacher_steps=6000",
    )
    overrides = next(action for action in p._actions if action.dest == "overrides")
    overrides.help += (
        ". With --stream, the fields of mhla_diffusion.embedded.builds.stream_build.StreamBuildSettings: "
        + (", ".join(dataclass_field_names(*STREAM_SETTINGS)))
    )
    p.set_defaults(func=run)


#: The streaming build's settings dataclass (``--stream``).
STREAM_SETTINGS = ("mhla_diffusion.embedded.builds.stream_build", "StreamBuildSettings")


def run(args: argparse.Namespace) -> int:
    import logging

    if args.stream:
        return run_stream(args)
    if args.diagnose:
        raise ValueError("--diagnose reads a streaming pilot: add --stream (and its --work-dir)")
    args.work_dir = args.work_dir or DEFAULT_WORK_DIR
    check_settings(
        args.overrides, "mhla_diffusion.embedded.builds.build_settings", "BuildSettings"
    )  # before torch loads
    from ..embedded.builds.build import build_demo_models
    from ..embedded.builds.build_settings import BuildSettings
    from ..ops.cpu_memory import retain_freed_memory
    from ..utils.options import settings_with

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = settings_with(BuildSettings.smoke() if args.smoke else BuildSettings(), args.overrides)
    if args.smoke and args.output == EMBEDDED_ROOT and not args.no_export:
        raise ValueError(
            "--smoke models are untrained: give --output for them (or --no-export), not the package folder"
        )
    # glibc would hand every large freed block back and page-fault it in again; the library would keep freed
    # memory only from its first MHLA call on (cpu_memory). MHLA_KEEP_MALLOC=1 opts out
    retain_freed_memory()
    report = build_demo_models(
        args.work_dir,
        None if args.no_export else args.output,
        settings,
        args.overwrite,
        figure=None if args.no_export else args.figure,
        from_build=args.from_build,
    )
    print((args.work_dir / "reproduction.md").read_text())
    print(f"total {report['total_seconds']:.0f} s; stage results: {args.work_dir / 'stages'}")
    return 0


def run_stream(args: argparse.Namespace) -> int:
    """``mhla build-embedded --stream`` (:mod:`mhla_diffusion.embedded.builds.stream_build`)."""
    import logging

    check_settings(args.overrides, *STREAM_SETTINGS)  # before torch loads
    if args.smoke and args.output == EMBEDDED_ROOT and not args.no_export:
        raise ValueError(
            "--smoke models are untrained: give --output for them (or --no-export), not the package folder"
        )
    from ..embedded.builds.stream_build import StreamBuildSettings, build_stream_models
    from ..ops.cpu_memory import retain_freed_memory
    from ..utils.options import settings_with

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = settings_with(StreamBuildSettings.smoke() if args.smoke else StreamBuildSettings(), args.overrides)
    retain_freed_memory()
    work = args.work_dir or DEFAULT_STREAM_WORK_DIR
    if args.diagnose:
        return _diagnose(work, args.overrides)
    report = build_stream_models(
        work,
        None if args.no_export else args.output,
        settings,
        from_build=args.from_build,
        figure=None if args.no_export else args.figure,
        overwrite=args.overwrite,
    )
    print((work / "evaluate" / "long_video_report.md").read_text())
    print(f"total {report['total_seconds']:.0f} s; stage results: {work / 'stages'}")
    return 0


def _diagnose(work: Path, overrides: list[str]) -> int:
    """``--stream --diagnose``: the pilot's settings (its ``settings.json``, then ``--set``) and its readings."""
    import dataclasses
    import json

    from ..embedded.builds.long_video_diagnosis import diagnose_pilot, diagnosis_markdown
    from ..embedded.builds.stream_build import StreamBuildSettings
    from ..utils.options import settings_with

    recorded = work / "settings.json"
    if not recorded.is_file():
        raise FileNotFoundError(f"{recorded} does not exist: give --work-dir the folder of a `--stream` pilot")
    names = {f.name for f in dataclasses.fields(StreamBuildSettings)}
    settings = StreamBuildSettings(**{k: v for k, v in json.loads(recorded.read_text()).items() if k in names})
    results = diagnose_pilot(work, settings_with(settings, overrides))
    print(diagnosis_markdown(results))
    print(f"readings: {work / 'diagnosis'}")
    return 0
