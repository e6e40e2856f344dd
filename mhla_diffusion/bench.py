"""``mhla bench``: MHLA beside softmax (SDPA) and global linear attention, on the same inputs.

Table 1 times the attention operators alone on token grids up to Wan's 21x30x50 video grid.
Table 2 times one whole Wan transformer block at the real 1.3B width with its default (SDPA)
self-attention and with MHLA: the end-to-end ratio a user feels. Times are medians over repeats;
memory is the peak extra tensor memory of one call (GPU: allocator peak; CPU: tracked tensors).
The command line (cases, defaults, printing) is :mod:`mhla_diffusion.cli.bench`.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .attention import mhla_attention
from .block_layout import auto_layout, num_blocks, validate_grid_layout
from .geometry import VideoGeometry
from .mixing import mixing_init

__all__ = ["ATTENTION_COLUMNS", "BLOCK_COLUMNS", "BenchCase", "PeakMemory", "attention_table", "format_table",
           "time_call", "wan_block_table"]

@dataclass(frozen=True)
class BenchCase:
    """A token grid and the MHLA block layout to run on it."""

    grid: tuple[int, ...]
    layout: tuple[int, ...]
    auto: bool

    @classmethod
    def of(cls, grid: Sequence[int], layout: Sequence[int] | None = None) -> "BenchCase":
        """The case of ``grid`` with ``layout``, or with the auto layout when it is ``None``; checked."""
        grid = tuple(int(g) for g in grid)
        chosen = tuple(int(b) for b in layout) if layout is not None else auto_layout(grid)
        validate_grid_layout(grid, chosen)
        return cls(grid, chosen, layout is None)

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)


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
    wan = VideoGeometry()  # Wan2.1's patch and RoPE table
    rope = WanRotaryPosEmbed(dim // heads, wan.patch_size, max_seq_len=wan.max_tokens_per_axis).to(device)
    rotary = rope(torch.zeros(1, 1, *(g * p for g, p in zip(grid, wan.patch_size)), device=device))

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
