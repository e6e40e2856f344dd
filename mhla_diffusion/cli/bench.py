"""``mhla bench``: time MHLA beside softmax (SDPA) and linear attention (:mod:`mhla_diffusion.benchmarks.bench`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..utils.choices import WEIGHT_DTYPES
from ..utils.options import at_least, number
from .arguments import add_command, parse_device, parse_sizes, positive_int

__all__ = ["DEFAULT_CASES", "parse_case", "register"]

#: Default cases: GRID (auto layout) or GRID:LAYOUT. The 195-block layout shows why M must stay near sqrt(N);
#: 21x30x52 is Wan2.1's default 480x832 video, whose blocks differ in size.
DEFAULT_CASES = ("5x16x16", "9x20x26", "9x20x26:3x5x13", "9x30x50", "21x30x50:3x5x10", "21x30x52:3x5x10")


def parse_case(text: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``GRID`` or ``GRID:LAYOUT`` (sizes like ``21x30x50``) -> ``(grid, layout or None for auto)``."""
    grid, _, layout = text.partition(":")
    return parse_sizes(grid), parse_sizes(layout) if layout else None


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "bench",
        configure,
        help="time MHLA beside SDPA and linear attention (operator, a full Wan block, a Wan transformer)",
        description="Print tables measured in one run on the same inputs: the attention operators on token "
        "grids up to 21x30x50, one Wan2.1-1.3B transformer block with SDPA vs MHLA self-attention, and (by "
        "default on a GPU) a whole Wan2.1-1.3B-shaped transformer forward with a few blocks, stock per SDPA "
        "backend vs MHLA. On a CPU the measurement runs in a fresh Python process (see --malloc).",
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--case",
        action="append",
        type=parse_case,
        help=f"GRID or GRID:LAYOUT (repeatable; default {' '.join(DEFAULT_CASES)})",
    )
    p.add_argument(
        "--heads", type=positive_int, help="attention heads (default 12, Wan2.1-1.3B; --families: each model's)"
    )
    p.add_argument("--head-dim", type=positive_int, help="head dim (default 128; --families: each model's)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds per measurement; the median is shown")
    p.add_argument(
        "--quick-passes",
        type=positive_int,
        default=5,
        help="runs per round of an operator under 1 s per call, interleaved with the others (default 5)",
    )
    p.add_argument(
        "--warmup",
        type=number(int, at_least(0, zero="no untimed runs")),
        default=1,
        help="untimed runs before timing the operators (default 1)",
    )
    p.add_argument("--device", type=parse_device, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=WEIGHT_DTYPES, help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument(
        "--sdpa-backend",
        action="append",
        help="Diffusers attention backend(s) for SDPA (default: native, "
        "plus on a GPU those of _native_flash, flash, _flash_3 and xformers that run there)",
    )
    p.add_argument("--sdpa-max-tokens", type=positive_int, help="skip SDPA above this many tokens")
    p.add_argument(
        "--block-grid",
        type=parse_sizes,
        default="21x30x50",
        help="token grid of the Wan block table (default 21x30x50)",
    )
    p.add_argument("--block-layout", type=parse_sizes, help="MHLA layout in the Wan block table (default: auto)")
    p.add_argument("--block-dim", type=positive_int, default=1536)
    p.add_argument("--block-heads", type=positive_int, default=12)
    p.add_argument("--block-ffn", type=positive_int, default=8960)
    p.add_argument("--block-text-tokens", type=positive_int, default=512)
    p.add_argument("--no-block", dest="block", action="store_false", help="skip the Wan block and transformer tables")
    p.add_argument(
        "--transformer-layers",
        type=number(int, at_least(0, zero="the whole-transformer table is skipped")),
        help="blocks of the whole Wan2.1-1.3B-shaped transformer forward "
        "(stock per SDPA backend vs MHLA) on the block grid; default 4 on a GPU, 0 (skipped) on a CPU",
    )
    p.add_argument(
        "--malloc",
        choices=("auto", "default", "retain"),
        default="auto",
        help="CPU, always measured in a fresh Python process: auto (default) as a user's own script "
        "gets it (the library keeps freed memory from its first CPU MHLA call on, see "
        "mhla_diffusion.ops.cpu_memory), "
        "default keeps glibc's defaults throughout (MHLA_KEEP_MALLOC=1), retain calls "
        "retain_freed_memory() first",
    )
    p.add_argument("--threads", type=positive_int, help="CPU threads of the measuring process (default: torch's)")
    p.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="measure N times, each in its own fresh Python process, one after the other: the tables show "
        "medians across the processes, and a last table lists MHLA / linear in each process with the median "
        "and max / min (also under 'processes' in --output's JSON). On a shared or virtual machine one process "
        "is one draw: e.g. its threads may or may not share a cache for the whole process (default 1)",
    )
    p.add_argument("--output", type=Path, help="also write the tables and settings as JSON here")
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="measure nothing: print the tables of a JSON written "
        "by --output (with --write-doc: put them into the docs page)",
    )
    p.add_argument(
        "--write-doc",
        type=Path,
        metavar="PAGE",
        help="also write the tables into the Markdown page PAGE "
        "(docs/speed.md) between <!-- mhla-bench:cuda --> and <!-- /mhla-bench:cuda --> (cpu for a CPU run)",
    )
    traffic = p.add_argument_group("traffic (--traffic): bytes moved by one MHLA attention call, counted, not timed")
    traffic.add_argument(
        "--traffic",
        action="store_true",
        help="count the bytes every op of one Wan2.1-1.3B MHLA "
        "self-attention call reads and writes (meta tensors: nothing is computed, any machine), in "
        "U = N x H x D x the dtype's bytes and as a multiple of the floor (q, k, v read and the output "
        "written once, plus the float32 block summaries written and read once)",
    )
    traffic.add_argument(
        "--traffic-grid",
        action="append",
        type=parse_sizes,
        help="token grid to count (repeatable; default 21x30x50 and 21x30x52)",
    )
    load = p.add_argument_group("loading (--load): peak memory and time of loading a full-size Wan transformer")
    load.add_argument(
        "--load",
        action="store_true",
        help="measure loading instead of attention: the published "
        "Wan config with random weights made here, each load in a fresh process (Linux)",
    )
    load.add_argument(
        "--load-model",
        default="Wan2.1-T2V-1.3B",
        help="published transformer config (default Wan2.1-T2V-1.3B; see mhla_diffusion.utils.wan_configs)",
    )
    load.add_argument("--load-layers", type=positive_int, help="transformer blocks (default: the published number)")
    load.add_argument(
        "--load-work-dir",
        type=Path,
        help="keep the written weights here and reuse them on the next "
        "run (default: a temporary folder, removed afterwards)",
    )
    families = p.add_argument_group(
        "families (--families): each model family's self-attention at its published size, MHLA beside SDPA"
    )
    families.add_argument(
        "--families",
        action="store_true",
        help="time one self-attention of each family's published model (Wan, SkyReels-V2, HunyuanVideo, LTX-Video, "
        "CogVideoX, SANA-Video, Flux) at its default size, joint text tokens included; SDPA skipped above "
        f"--sdpa-max-tokens (default on a CPU {FAMILIES_CPU_SDPA_MAX_TOKENS:,})",
    )
    families.add_argument(
        "--family",
        action="append",
        type=parse_family,
        help="NAME or NAME:GRID, one family's row (repeatable; default every family at its published size)",
    )
    add_stream_arguments(p)
    p.set_defaults(func=run)


#: ``--families`` on a CPU: SDPA above this many tokens takes minutes per call, and is left out.
FAMILIES_CPU_SDPA_MAX_TOKENS = 20_000


def parse_family(text: str) -> tuple[str, tuple[int, ...] | None]:
    """``NAME`` or ``NAME:GRID`` (``flux:32x32``) of ``--family``."""
    name, _, grid = text.partition(":")
    return name.strip(), parse_sizes(grid) if grid else None


def add_stream_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--stream`` options (:mod:`mhla_diffusion.benchmarks.stream`); the width is the --block-* options'."""
    stream = p.add_argument_group(
        "streaming (--stream): peak memory and seconds per chunk of video generated chunk by chunk, at growing "
        "lengths: streaming MHLA, softmax with a KV cache, one-pass bidirectional MHLA (--block-dim, --block-heads, "
        "--block-ffn, --block-text-tokens set the width)"
    )
    stream.add_argument(
        "--stream",
        action="store_true",
        help="measure streaming instead of attention, on a Wan2.1-1.3B-shaped transformer with random weights",
    )
    stream.add_argument(
        "--stream-chunk",
        type=parse_sizes,
        default=(3, 15, 26),
        help="token grid of one chunk: latent frames x height x width (default 3x15x26: the streaming pipeline's "
        "default chunk of 3 latent frames, at 240x416)",
    )
    stream.add_argument("--stream-base", type=positive_int, default=2, help="chunks of the base length (default 2)")
    stream.add_argument(
        "--stream-multiples", type=parse_sizes, default=(1, 2, 4, 8), help="lengths in base lengths (default 1,2,4,8)"
    )
    stream.add_argument("--stream-layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    stream.add_argument(
        "--stream-blocks",
        type=parse_sizes,
        default=(3, 5),
        help="causal MHLA blocks per latent frame, height x width (default 3x5)",
    )
    stream.add_argument(
        "--stream-window", type=number(int, at_least(0)), help="causal window K (default: MHLAConfig's causal_window)"
    )
    stream.add_argument(
        "--stream-state",
        action="store_true",
        help="instead of timing, compute what a stream's MHLA state weighs at Wan2.1-1.3B 480p per layout and "
        "storage dtype (against bf16 KV caches), and the error of storing it in 2 bytes, per fold, at 64, 256 and "
        "1,024 rows (about half a minute); --write-doc puts the tables in section mhla-bench:stream-state",
    )
    stream.add_argument(
        "--stream-one-pass-max-tokens",
        type=positive_int,
        help="skip the one-pass bidirectional MHLA rows above this many tokens (default: none skipped)",
    )


def run(args: argparse.Namespace) -> int:
    if args.processes > 1 and (args.load or args.traffic or args.stream or args.report is not None):
        raise ValueError(
            "--processes repeats the operator and Wan tables; it does not apply to --load, --traffic, "
            "--stream or --report"
        )
    if args.load:
        return run_load(args)
    if args.families or args.family:
        return run_families(args)
    if args.traffic:
        return run_traffic(args)
    if args.stream_state:
        return run_stream_state(args)
    import json
    import sys

    if args.report is not None:  # tables of an earlier run, nothing measured
        result = json.loads(args.report.read_text())
    else:
        result = _measure_stream(args) if args.stream else _measure(args)
        if args.output is not None:
            args.output.write_text(json.dumps(result, indent=2) + "\n")

    from ..benchmarks.bench import replace_marked_section, report_markdown
    from ..benchmarks.stream import stream_report_markdown, stream_section

    streamed = "stream" in result  # a result of --stream
    tables = stream_report_markdown(result) if streamed else report_markdown(result)
    print(tables)
    if args.write_doc is not None:
        section = stream_section(result) if streamed else result["device_type"]
        args.write_doc.write_text(replace_marked_section(args.write_doc.read_text(), section, tables))
        print(f"wrote the tables into {args.write_doc} (section mhla-bench:{section})", file=sys.stderr)
    return 0


def _measure(args: argparse.Namespace) -> dict:
    """Check the arguments, then measure: on a CPU in a fresh process (the allocator that --malloc names)."""
    import sys

    import torch

    from ..benchmarks.bench import BenchCase, BenchSpec, measure, measure_in_fresh_process, measure_in_fresh_processes
    from ..utils.geometry import validate_grid_layout

    cases = [BenchCase.of(grid, layout) for grid, layout in (args.case or [parse_case(c) for c in DEFAULT_CASES])]
    if args.block:
        if len(args.block_grid) != 3:
            raise ValueError("--block-grid must be frames x height x width, e.g. 21x30x50")
        validate_grid_layout(args.block_grid, args.block_layout or (1, 1, 1))
    if args.repeats < 1 or args.quick_passes < 1 or args.warmup < 0:
        raise ValueError("--repeats and --quick-passes must be >= 1 and --warmup >= 0")
    if (args.transformer_layers or 0) < 0 or (args.threads is not None and args.threads < 1):
        raise ValueError("--transformer-layers must be >= 0 and --threads >= 1")
    if args.output is not None and args.output.exists():
        raise FileExistsError(f"{args.output} exists; choose another --output")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layers = args.transformer_layers if args.transformer_layers is not None else (4 if device.type == "cuda" else 0)
    spec = BenchSpec(
        cases=[(case.grid, None if case.auto else case.layout) for case in cases],
        heads=args.heads or 12,
        head_dim=args.head_dim or 128,
        dtype=args.dtype or ("bfloat16" if device.type == "cuda" else "float32"),
        device=str(device),
        repeats=args.repeats,
        quick_passes=args.quick_passes,
        warmup=args.warmup,
        sdpa_backends=args.sdpa_backend,
        sdpa_max_tokens=args.sdpa_max_tokens,
        block_grid=args.block_grid if args.block else None,
        block_layout=args.block_layout,
        block_dim=args.block_dim,
        block_heads=args.block_heads,
        block_ffn=args.block_ffn,
        block_text_tokens=args.block_text_tokens,
        transformer_layers=layers,
        malloc=args.malloc,
        threads=args.threads,
    )
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if args.processes > 1:
        return measure_in_fresh_processes(spec, args.processes, log)
    if device.type == "cpu":
        log("one fresh process: --processes N measures N of them and shows the spread of MHLA / linear")
        return measure_in_fresh_process(spec)
    return measure(spec, log)


def _measure_stream(args: argparse.Namespace) -> dict:
    """Check the ``--stream`` arguments, then measure (on a CPU in a fresh process, as :func:`_measure`)."""
    import sys

    import torch

    from ..benchmarks.bench import measure_in_fresh_process, replace_marked_section
    from ..benchmarks.stream import StreamSpec, measure_stream, stream_section

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    window = {} if args.stream_window is None else {"window": args.stream_window}
    spec = StreamSpec(  # checks the settings: one clear line before anything is built
        chunk_grid=args.stream_chunk,
        base_chunks=args.stream_base,
        multiples=args.stream_multiples,
        layers=args.stream_layers,
        blocks=args.stream_blocks,
        dim=args.block_dim,
        heads=args.block_heads,
        ffn_dim=args.block_ffn,
        text_tokens=args.block_text_tokens,
        one_pass_max_tokens=args.stream_one_pass_max_tokens,
        dtype=args.dtype or ("bfloat16" if device.type == "cuda" else "float32"),
        device=str(device),
        repeats=args.repeats,
        quick_passes=args.quick_passes,
        warmup=args.warmup,
        malloc=args.malloc,
        threads=args.threads,
        **window,
    )
    if args.output is not None and args.output.exists():
        raise FileExistsError(f"{args.output} exists; choose another --output")
    if args.write_doc is not None:  # the page must have the section before minutes of measuring
        replace_marked_section(args.write_doc.read_text(), stream_section({"device_type": device.type}), "")
    if device.type == "cpu":
        return measure_in_fresh_process(spec, "mhla_diffusion.benchmarks.stream")
    return measure_stream(spec, lambda text: print(text, file=sys.stderr, flush=True))


def run_stream_state(args: argparse.Namespace) -> int:
    """``--stream-state``: the state's size and its storage error (:mod:`mhla_diffusion.benchmarks.stream_state`)."""
    import json
    import sys

    from ..benchmarks.bench import replace_marked_section
    from ..benchmarks.stream_state import state_error_rows, state_report_markdown, state_size_rows

    if args.write_doc is not None:  # a page without the section is refused before the half minute of work
        replace_marked_section(args.write_doc.read_text(), "stream-state", "")
    if args.output is not None and args.output.exists():
        raise FileExistsError(f"{args.output} exists; choose another --output")
    sizes, errors = state_size_rows(), state_error_rows()
    tables = state_report_markdown(sizes, errors)
    print(tables)
    if args.output is not None:
        args.output.write_text(json.dumps({"size": sizes, "error": errors}, indent=2) + "\n")
    if args.write_doc is not None:
        args.write_doc.write_text(replace_marked_section(args.write_doc.read_text(), "stream-state", tables))
        print(f"wrote the tables into {args.write_doc} (section mhla-bench:stream-state)", file=sys.stderr)
    return 0


def run_traffic(args: argparse.Namespace) -> int:
    """``mhla bench --traffic``: the table of :func:`mhla_diffusion.benchmarks.attention_traffic.traffic_table`."""
    import json

    import torch

    from ..benchmarks.attention_traffic import TRAFFIC_COLUMNS, TRAFFIC_GRIDS, TRAFFIC_PATHS, traffic_table
    from ..benchmarks.bench import format_table

    grids = args.traffic_grid or TRAFFIC_GRIDS
    for grid in grids:
        if len(grid) != 3:
            raise ValueError(f"--traffic-grid must be frames x height x width, e.g. 21x30x50; got {grid}")
    if args.output is not None and args.output.exists():
        raise FileExistsError(f"{args.output} exists; choose another --output")
    dtype = getattr(torch, args.dtype or "bfloat16")
    from ..benchmarks.stream_state import STREAM_TRAFFIC_SETTING, stream_chunk_traffic

    rows = traffic_table(grids, dtype)
    for fused, path in ((False, TRAFFIC_PATHS[0]), (True, TRAFFIC_PATHS[1])):  # last, a stream's denoising chunk
        rows.append({**stream_chunk_traffic(dtype=dtype, fused=fused), "setting": STREAM_TRAFFIC_SETTING, "path": path})
    print(
        f"# mhla bench --traffic: one MHLA self-attention call of Wan2.1-1.3B (12 heads x 128, {dtype}), "
        f"counted op by op on meta tensors; U = N x 12 x 128 x {dtype.itemsize} bytes\n"
    )
    print(format_table(rows, TRAFFIC_COLUMNS))
    if args.output is not None:
        args.output.write_text(json.dumps({"traffic": rows}, indent=2) + "\n")
    return 0


def run_families(args: argparse.Namespace) -> int:
    """``mhla bench --families``: the table of :func:`mhla_diffusion.benchmarks.families.family_attention_table`."""
    import json
    import sys

    import torch

    from ..benchmarks.bench import format_table
    from ..benchmarks.families import FAMILY_COLUMNS, FAMILY_MODELS, family_attention_table

    chosen = args.family or [(name, None) for name in FAMILY_MODELS]
    unknown = [name for name, _ in chosen if name not in FAMILY_MODELS]
    if unknown:
        raise ValueError(f"--family {', '.join(unknown)}: choose from {', '.join(FAMILY_MODELS)}")
    if args.output is not None and args.output.exists():
        raise FileExistsError(f"{args.output} exists; choose another --output")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cap = args.sdpa_max_tokens or (FAMILIES_CPU_SDPA_MAX_TOKENS if device.type == "cpu" else None)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    rows = family_attention_table(
        [name for name, _ in chosen],
        {name: grid for name, grid in chosen if grid is not None},
        args.heads,
        args.head_dim,
        dtype,
        device,
        args.repeats,
        args.warmup,
        cap,
        log,
    )
    threads = torch.get_num_threads() if device.type == "cpu" else None
    print(
        f"# mhla bench --families: one self-attention call per family, {device.type}"
        + (f" ({threads} threads)" if threads else "")
        + f", {str(dtype).removeprefix('torch.')}, median of {args.repeats} interleaved rounds; seconds from the "
        "raw projections (projections, norms and RoPE left out); SDPA over image + text tokens"
        + (f", skipped above {cap:,} tokens" if cap else "")
        + "\n"
    )
    print(format_table(rows, FAMILY_COLUMNS))
    if args.output is not None:
        result = {"device": device.type, "dtype": str(dtype), "threads": threads, "families": rows}
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def run_load(args: argparse.Namespace) -> int:
    """``mhla bench --load``: the table of :mod:`mhla_diffusion.benchmarks.load`."""
    import json
    import sys

    from ..utils.wan_configs import wan_transformer_config

    config = wan_transformer_config(args.load_model)  # unknown names fail here, before any work
    if args.load_layers is not None:
        if args.load_layers < 1:
            raise ValueError("--load-layers must be >= 1")
        config["num_layers"] = args.load_layers
    if args.output is not None and args.output.exists():
        raise FileExistsError(f"{args.output} exists; choose another --output")

    from ..benchmarks.bench import format_table
    from ..benchmarks.load import LOAD_COLUMNS, load_table, parameter_count

    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    rows = load_table(config, work_dir=args.load_work_dir, log=log)
    print(
        f"# mhla bench --load: {args.load_model} config, {config['num_layers']} blocks, "
        f"{parameter_count(config) / 1e9:.2f} B parameters (random weights), each load in a fresh process\n"
    )
    print(format_table(rows, LOAD_COLUMNS))
    if args.output is not None:
        args.output.write_text(json.dumps({"model": args.load_model, "config": config, "load": rows}, indent=2) + "\n")
    return 0
