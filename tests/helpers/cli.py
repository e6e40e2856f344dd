"""``mhla`` command lines on the tiny models: generation on the ``pipeline_dirs`` fixture's pipelines
(with their MHLA weights), a ``mhla bench`` small enough for a test, and the evaluation commands' parser."""

from __future__ import annotations

import argparse
from pathlib import Path

from mhla_diffusion.cli import main

#: A fast clip of the tiny Wan pipeline: 9 frames of 32x48 pixels, 16 text tokens.
TINY_VIDEO = ("--num-frames", "9", "--height", "32", "--width", "48", "--max-sequence-length", "16")

#: ``mhla bench``'s Wan model at toy size: 32 wide, 2 heads, FFN 64, 4 text tokens.
TINY_WAN_BLOCK = ("--block-dim", "32", "--block-heads", "2", "--block-ffn", "64", "--block-text-tokens", "4")

#: ``mhla bench`` at toy size: one 2x4x6 case of 2 heads of 8 channels, one round, a 2x4x4 :data:`TINY_WAN_BLOCK`.
TINY_BENCH = (
    "--case",
    "2x4x6",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--repeats",
    "1",
    "--block-grid",
    "2x4x4",
    *TINY_WAN_BLOCK,
)


def text_to_video(dirs: dict, out: str | Path, *extra: str, steps: int = 2, weights: bool = True) -> int:
    """``mhla text-to-video`` on the tiny Wan pipeline with its MHLA weights (without: not ``weights``),
    :data:`TINY_VIDEO` and ``steps`` denoising steps, writing into ``out``; ``extra`` comes last (a repeated
    option there wins). The exit code."""
    return main(
        [
            "text-to-video",
            "--model",
            str(dirs["wan"]),
            *(["--mhla-weights", str(dirs["wan_mhla"])] if weights else []),
            "--output-dir",
            str(out),
            *TINY_VIDEO,
            "--steps",
            str(steps),
            *extra,
        ]
    )


def class_to_image(dirs: dict, out: str | Path, *extra: str, steps: int = 1) -> int:
    """``mhla class-to-image`` on the tiny DiT pipeline with its MHLA weights and ``steps`` denoising steps,
    writing into ``out``; ``extra`` comes last. The exit code."""
    return main(
        [
            "class-to-image",
            "--model",
            str(dirs["dit"]),
            "--mhla-weights",
            str(dirs["dit_mhla"]),
            "--steps",
            str(steps),
            "--output-dir",
            str(out),
            *extra,
        ]
    )


def parse_eval_command(argv: list[str]) -> argparse.Namespace:
    """``argv`` (``["eval", ...]``, ``["eval-sample", ...]``) parsed by the evaluation commands' own parser
    (:mod:`mhla_diffusion.cli.evaluate`), to call ``args.func(args)`` in the test's process."""
    from mhla_diffusion.cli import evaluate

    parser = argparse.ArgumentParser(prog="mhla")
    evaluate.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)
