"""``mhla bench``: MHLA beside softmax (SDPA) and global linear attention, on the same inputs.

Table 1 times the attention operators alone on token grids up to Wan's 21x30x50 video grid.
Table 2 times one whole Wan transformer block at the real 1.3B width with its default (SDPA)
self-attention and with MHLA: the end-to-end ratio a user feels. Times are medians over repeats;
memory is the peak extra tensor memory of one call (GPU: allocator peak; CPU: tracked tensors).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .attention import mhla_attention
from .block_layout import auto_layout, num_blocks, validate_grid_layout
from .cpu_memory import retain_freed_memory
from .mixing import mixing_init

__all__ = ["BenchCase", "PeakMemory", "attention_table", "format_table", "register", "time_call", "wan_block_table"]

#: Default cases: (grid, layout or None for auto). The 195-block layout shows why M must stay near sqrt(N).
DEFAULT_CASES = ("5x16x16", "9x20x26", "9x20x26:3x5x13", "21x30x50:3x5x10")


@dataclass(frozen=True)
class BenchCase:
    """A token grid and the MHLA block layout to run on it."""

    grid: tuple[int, ...]
    layout: tuple[int, ...]
    auto: bool

    @classmethod
    def parse(cls, text: str) -> "BenchCase":
        """``GRID`` (auto layout) or ``GRID:LAYOUT``, sizes written like ``21x30x50``."""
        grid_text, _, layout_text = text.partition(":")
        grid = _sizes(grid_text)
        layout = _sizes(layout_text) if layout_text else auto_layout(grid)
        validate_grid_layout(grid, layout)
        return cls(grid, layout, not layout_text)

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in re.split(r"[x,]", text.strip()))
    except ValueError:
        raise ValueError(f"expected sizes like 21x30x50, got {text!r}") from None


class PeakMemory(TorchDispatchMode):
    """Peak extra tensor memory of the code inside the ``with`` block, in bytes (``.peak``).

    CUDA: the caching allocator's peak above what was allocated on entry. CPU: every tensor that a
    torch operation creates inside the block is tracked until its storage is freed, and the peak
    of the live total is kept (exact at operation granularity; tensors made before the block, such
    as the inputs, do not count).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.peak = 0
        self._live: dict[int, tuple[int, list[weakref.ref]]] = {}

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in self._live:
                    self._live[key][1].append(weakref.ref(tensor))
                elif key not in inputs and storage.nbytes():  # a view of untracked memory is not new memory
                    self._live[key] = (storage.nbytes(), [weakref.ref(tensor)])
        self._live = {k: (n, refs) for k, (n, refs) in self._live.items() if any(r() is not None for r in refs)}
        self.peak = max(self.peak, sum(n for n, _ in self._live.values()))
        return out


def time_call(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> tuple[float, int]:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs, and the peak extra memory of one run."""
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        sync()
        with PeakMemory(device) as memory:
            fn()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - started)
    return statistics.median(times), memory.peak


def _sdpa_backends(device: torch.device, requested: Sequence[str] | None) -> list[str]:
    """Diffusers attention backends to time: ``native`` everywhere, plus flash/xformers on a GPU when they run."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    names = list(requested) if requested else ["native"] + (["flash", "xformers"] if device.type == "cuda" else [])
    usable = []
    probe = torch.rand(1, 8, 1, 64, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    for name in names:
        try:
            dispatch_attention_fn(probe, probe, probe, backend=AttentionBackendName(name))
            usable.append(name)
        except Exception:  # backend not installed or not supported here: leave it out of the table
            if requested:
                raise
    return usable


def attention_table(
    cases: Sequence[BenchCase],
    heads: int = 12,
    head_dim: int = 128,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    warmup: int = 1,
    sdpa_backends: Sequence[str] | None = None,
    sdpa_max_tokens: int | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict]:
    """Time SDPA, global linear attention and MHLA on the same random inputs for every case."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    device = torch.device(device)
    backends = _sdpa_backends(device, sdpa_backends)
    rows = []
    inputs: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
    for case in cases:
        if case.grid not in inputs:
            g = torch.Generator().manual_seed(0)
            shape = (1, case.tokens, heads, head_dim)
            inputs = {case.grid: tuple(  # one grid's inputs alive at a time
                x.to(device, dtype) for x in (torch.rand(shape, generator=g), torch.rand(shape, generator=g), torch.randn(shape, generator=g))
            )}
        q, k, v = inputs[case.grid]
        io_bytes = 4 * q.numel() * q.element_size()  # q, k, v and the output
        ones = (1,) * len(case.grid)
        methods: list[tuple[str, Callable[[], object]]] = []
        if sdpa_max_tokens is None or case.tokens <= sdpa_max_tokens:
            for name in backends:
                backend = AttentionBackendName(name)
                methods.append((f"sdpa ({name})", lambda b=backend: dispatch_attention_fn(q, k, v, backend=b)))
        one = torch.ones(1, 1, device=device, dtype=dtype)
        methods.append(("linear", lambda: mhla_attention(q, k, v, case.grid, ones, one)))
        mixing = mixing_init(case.layout).to(device, dtype)
        methods.append(("mhla", lambda: mhla_attention(q, k, v, case.grid, case.layout, mixing)))
        timings = {}
        for name, fn in methods:
            log(f"  {'x'.join(map(str, case.grid))} {name} ...")
            timings[name] = time_call(fn, repeats, warmup, device)
        linear, mhla = timings["linear"][0], timings["mhla"][0]
        sdpa = min((t for n, (t, _) in timings.items() if n.startswith("sdpa")), default=None)
        for name, (seconds, peak) in timings.items():
            rows.append({
                "grid": "x".join(map(str, case.grid)),
                "tokens": case.tokens,
                "layout": "x".join(map(str, case.layout)) + (" (auto)" if case.auto else ""),
                "blocks": num_blocks(case.layout),
                "method": name,
                "median_ms": seconds * 1e3,
                "peak_extra_mb": peak / 2**20,
                "extra_vs_io": peak / io_bytes,
            })
        rows[-1].update(sdpa_over_mhla=None if sdpa is None else sdpa / mhla, mhla_over_linear=mhla / linear)
    return rows


def wan_block_table(
    grid: tuple[int, int, int],
    layout: tuple[int, int, int] | None = None,
    dim: int = 1536,
    heads: int = 12,
    ffn_dim: int = 8960,
    text_tokens: int = 512,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    warmup: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict]:
    """Time one ``WanTransformerBlock`` with its default processor and with MHLA on the same inputs."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

    from .config import MHLAConfig
    from .processors.grid import TokenGridContext
    from .processors.wan import WanMHLAProcessor

    device = torch.device(device)
    layout = layout or auto_layout(grid)
    torch.manual_seed(0)
    block = WanTransformerBlock(dim, ffn_dim, heads, qk_norm="rms_norm_across_heads", cross_attn_norm=True, eps=1e-6)
    block = block.to(device, dtype).eval()
    tokens = math.prod(grid)
    hidden = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    text = torch.randn(1, text_tokens, dim, device=device, dtype=dtype)
    temb = torch.randn(1, 6, dim, device=device, dtype=dtype)
    rope = WanRotaryPosEmbed(dim // heads, (1, 2, 2), max_seq_len=1024).to(device)
    rotary = rope(torch.zeros(1, 1, grid[0], 2 * grid[1], 2 * grid[2], device=device))

    default_processor = block.attn1.processor
    context = TokenGridContext()
    context.grid = tuple(grid)
    mhla_processor = WanMHLAProcessor(heads, dim // heads, layout, MHLAConfig(layout=layout), context).to(device, dtype)
    timings = {}
    for name, processor in (("default (sdpa)", default_processor), ("mhla", mhla_processor)):
        block.attn1.set_processor(processor)
        log(f"  Wan block {name} ...")
        timings[name] = time_call(lambda: block(hidden, text, temb, rotary), repeats, warmup, device)
    rows = [
        {
            "grid": "x".join(map(str, grid)),
            "tokens": tokens,
            "layout": "x".join(map(str, layout)),
            "method": name,
            "median_s": seconds,
            "peak_extra_mb": peak / 2**20,
        }
        for name, (seconds, peak) in timings.items()
    ]
    rows[-1]["sdpa_over_mhla"] = timings["default (sdpa)"][0] / timings["mhla"][0]
    return rows


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Markdown table; ``columns`` holds (key, header, format spec) triples; ``None`` prints as ``n/a``,
    a missing key as an empty cell."""
    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [header, rule]
    for row in rows:
        cells = [
            "" if key not in row else "n/a" if row[key] is None else format(row[key], spec) for key, _, spec in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ATTENTION_COLUMNS = (
    ("grid", "grid", ""), ("tokens", "N", ",d"), ("layout", "layout", ""), ("blocks", "M", "d"),
    ("method", "method", ""), ("median_ms", "median ms", ".1f"), ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("extra_vs_io", "extra / (q,k,v,out)", ".2f"), ("sdpa_over_mhla", "SDPA / MHLA", ".1f"),
    ("mhla_over_linear", "MHLA / linear", ".2f"),
)
BLOCK_COLUMNS = (
    ("grid", "grid", ""), ("tokens", "N", ",d"), ("layout", "layout", ""), ("method", "self-attention", ""),
    ("median_s", "median s", ".2f"), ("peak_extra_mb", "peak extra MiB", ".0f"), ("sdpa_over_mhla", "SDPA / MHLA", ".2f"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``mhla bench`` to the ``mhla`` parser."""
    p = subparsers.add_parser(
        "bench", help="time MHLA beside SDPA and linear attention (operator and a full Wan block)",
        description="Print two tables measured in one run on the same inputs: the attention operators on token "
        "grids up to 21x30x50, and one Wan2.1-1.3B transformer block with SDPA vs MHLA self-attention.",
    )
    p.add_argument("--case", action="append", help=f"GRID or GRID:LAYOUT (repeatable; default {' '.join(DEFAULT_CASES)})")
    p.add_argument("--heads", type=int, default=12, help="attention heads (default 12, Wan2.1-1.3B)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is shown")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing the operators (default 1)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument("--sdpa-backend", action="append", help="Diffusers attention backend(s) for SDPA (default: native, "
                   "plus flash and xformers on a GPU when installed)")
    p.add_argument("--sdpa-max-tokens", type=int, help="skip SDPA above this many tokens")
    p.add_argument("--block-grid", default="21x30x50", help="token grid of the Wan block table (default 21x30x50)")
    p.add_argument("--block-layout", help="MHLA layout in the Wan block table (default: auto)")
    p.add_argument("--block-dim", type=int, default=1536)
    p.add_argument("--block-heads", type=int, default=12)
    p.add_argument("--block-ffn", type=int, default=8960)
    p.add_argument("--block-text-tokens", type=int, default=512)
    p.add_argument("--no-block", dest="block", action="store_false", help="skip the Wan block table")
    p.add_argument("--malloc", choices=("retain", "default"), default="retain",
                   help="CPU: retain (default) keeps freed memory for reuse (see mhla_diffusion.cpu_memory), "
                   "default leaves glibc as it is")
    p.add_argument("--output", type=Path, help="also write both tables as JSON here")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import json
    import platform
    import sys

    cases = [BenchCase.parse(c) for c in (args.case or DEFAULT_CASES)]
    block_grid = _sizes(args.block_grid)
    block_layout = _sizes(args.block_layout) if args.block_layout else None
    if args.block:
        if len(block_grid) != 3:
            raise ValueError("--block-grid must be frames x height x width, e.g. 21x30x50")
        validate_grid_layout(block_grid, block_layout or (1, 1, 1))
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
            block_grid, block_layout, args.block_dim, args.block_heads, args.block_ffn, args.block_text_tokens,
            dtype, device, args.repeats, 0, log,
        )
        print(f"\nOne Wan transformer block (dim {args.block_dim}, {args.block_heads} heads, ffn {args.block_ffn}, "
              f"cross-attention to {args.block_text_tokens} text tokens):\n")
        print(format_table(block_rows, BLOCK_COLUMNS))
    if args.output is not None:
        args.output.write_text(json.dumps({"device": where, "attention": rows, "wan_block": block_rows}, indent=2) + "\n")
    return 0
