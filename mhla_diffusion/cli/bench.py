"""``mhla bench``: time MHLA beside softmax (SDPA) and linear attention (:mod:`mhla_diffusion.bench`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import DTYPES, add_command, parse_sizes

__all__ = ["DEFAULT_CASES", "parse_case", "register"]

#: Default cases: GRID (auto layout) or GRID:LAYOUT. The 195-block layout shows why M must stay near sqrt(N).
DEFAULT_CASES = ("5x16x16", "9x20x26", "9x20x26:3x5x13", "21x30x50:3x5x10")


def parse_case(text: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``GRID`` or ``GRID:LAYOUT`` (sizes like ``21x30x50``) -> ``(grid, layout or None for auto)``."""
    grid, _, layout = text.partition(":")
    return parse_sizes(grid), parse_sizes(layout) if layout else None


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers, "bench", configure,
        help="time MHLA beside SDPA and linear attention (operator and a full Wan block)",
        description="Print two tables measured in one run on the same inputs: the attention operators on token "
        "grids up to 21x30x50, and one Wan2.1-1.3B transformer block with SDPA vs MHLA self-attention.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--case", action="append", type=parse_case,
                   help=f"GRID or GRID:LAYOUT (repeatable; default {' '.join(DEFAULT_CASES)})")
    p.add_argument("--heads", type=int, default=12, help="attention heads (default 12, Wan2.1-1.3B)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is shown")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing the operators (default 1)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument("--sdpa-backend", action="append", help="Diffusers attention backend(s) for SDPA (default: native, "
                   "plus flash and xformers on a GPU when installed)")
    p.add_argument("--sdpa-max-tokens", type=int, help="skip SDPA above this many tokens")
    p.add_argument("--block-grid", type=parse_sizes, default="21x30x50",
                   help="token grid of the Wan block table (default 21x30x50)")
    p.add_argument("--block-layout", type=parse_sizes, help="MHLA layout in the Wan block table (default: auto)")
    p.add_argument("--block-dim", type=int, default=1536)
    p.add_argument("--block-heads", type=int, default=12)
    p.add_argument("--block-ffn", type=int, default=8960)
    p.add_argument("--block-text-tokens", type=int, default=512)
    p.add_argument("--no-block", dest="block", action="store_false", help="skip the Wan block table")
    p.add_argument("--malloc", choices=("retain", "default"), default="retain",
                   help="CPU: retain (default) keeps freed memory for reuse (see mhla_diffusion.cpu_memory), "
                   "default leaves glibc as it is")
    p.add_argument("--output", type=Path, help="also write both tables as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import platform
    import sys

    import torch

    from ..bench import ATTENTION_COLUMNS, BLOCK_COLUMNS, BenchCase, attention_table, format_table, wan_block_table
    from ..cpu_memory import retain_freed_memory
    from ..geometry import validate_grid_layout

    cases = [BenchCase.of(grid, layout) for grid, layout in (args.case or [parse_case(c) for c in DEFAULT_CASES])]
    if args.block:
        if len(args.block_grid) != 3:
            raise ValueError("--block-grid must be frames x height x width, e.g. 21x30x50")
        validate_grid_layout(args.block_grid, args.block_layout or (1, 1, 1))
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    if args.output is not None and args.output.exists():
        raise FileExistsError(f"{args.output} exists; choose another --output")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        retained = args.malloc == "retain" and retain_freed_memory()
        where = (f"{platform.machine()} CPU, {torch.get_num_threads()} threads, "
                 f"malloc {'keeps freed memory' if retained else 'default'}")
    print(f"# mhla bench: {where}, {str(dtype).replace('torch.', '')}, torch {torch.__version__}, median of {args.repeats}")
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    rows = attention_table(
        cases, args.heads, args.head_dim, dtype, device, args.repeats, args.warmup, args.sdpa_backend,
        args.sdpa_max_tokens, log,
    )
    print(f"\nAttention operator, B=1, H={args.heads}, D={args.head_dim}:\n")
    print(format_table(rows, ATTENTION_COLUMNS))
    block_rows = []
    if args.block:
        block_rows = wan_block_table(
            args.block_grid, args.block_layout, args.block_dim, args.block_heads, args.block_ffn,
            args.block_text_tokens, dtype, device, args.repeats, 0, log,
        )
        print(f"\nOne Wan transformer block (dim {args.block_dim}, {args.block_heads} heads, ffn {args.block_ffn}, "
              f"cross-attention to {args.block_text_tokens} text tokens):\n")
        print(format_table(block_rows, BLOCK_COLUMNS))
    if args.output is not None:
        args.output.write_text(json.dumps({"device": where, "attention": rows, "wan_block": block_rows}, indent=2) + "\n")
    return 0
