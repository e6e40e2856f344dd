"""``mhla bench``: MHLA beside softmax (SDPA) and global linear attention, on the same inputs.

Table 1 times the attention operators alone on token grids up to Wan's 21x30x50 video grid.
Table 2 times one whole Wan transformer block at the real 1.3B width with its default (SDPA)
self-attention and with MHLA: the end-to-end ratio a user feels. Table 3 (optional, meant for
GPUs) times a whole Wan2.1-1.3B-shaped transformer forward with a few blocks, stock with every
usable SDPA backend (native, FlashAttention, ...) and converted to MHLA. Times are medians over
repeats; memory is the peak extra tensor memory of one call (GPU: allocator peak; CPU: tracked tensors).

A run is described by a :class:`BenchSpec` and returns a JSON-ready dict (:func:`measure`). On a
CPU the command measures in a fresh Python process (:func:`measure_in_fresh_process`), so that the
allocator is what a user's own script gets (see :mod:`mhla_diffusion.ops.cpu_memory`), not whatever the
calling process did before. :func:`report_markdown` turns a result (or its saved JSON) into the
tables, and :func:`replace_marked_section` writes them into ``docs/speed.md`` between markers.
The command line (cases, defaults, printing) is :mod:`mhla_diffusion.cli.bench`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import weakref
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import MHLAConfig
from ..ops.attention import mhla_attention
from ..ops.block_layout import auto_layout, num_blocks, validate_grid_layout
from ..ops.mixing import mixing_init
from ..utils.geometry import VideoGeometry

__all__ = [
    "ATTENTION_COLUMNS",
    "BLOCK_COLUMNS",
    "MALLOC_MODES",
    "PROCESS_COLUMNS",
    "TRANSFORMER_COLUMNS",
    "BenchCase",
    "BenchSpec",
    "PeakMemory",
    "attention_table",
    "combine_processes",
    "format_table",
    "measure",
    "measure_in_fresh_process",
    "measure_in_fresh_processes",
    "plain_linear_attention",
    "process_table",
    "replace_marked_section",
    "report_markdown",
    "time_call",
    "time_calls",
    "wan_block_table",
    "wan_transformer_table",
]

#: CPU allocator of a measuring process: ``auto`` as a user's own script gets it (glibc's defaults
#: until the library's first CPU MHLA call keeps freed memory, see :mod:`mhla_diffusion.ops.cpu_memory`),
#: ``default`` glibc's defaults throughout (``MHLA_KEEP_MALLOC=1``), ``retain`` kept from the start
#: (:func:`~mhla_diffusion.ops.cpu_memory.retain_freed_memory` first, as the CLI entry points do).
MALLOC_MODES = ("auto", "default", "retain")


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
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, live tensors on it]
        self._total = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocated_before = torch.cuda.memory_allocated(self.device)
            return self
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._allocated_before
            return None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                entry = self._live.get(key)
                if entry is None:
                    if inputs is None:
                        leaves = pytree.tree_leaves((args, kwargs))
                        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
                    if key in inputs or not storage.nbytes():  # a view of untracked memory is not new memory
                        continue
                    entry = self._live[key] = [storage.nbytes(), 0]
                    self._total += entry[0]
                entry[1] += 1  # one more live tensor on this storage; its finalizer takes it off
                weakref.finalize(tensor, self._release, key, entry)
        self.peak = max(self.peak, self._total)
        return out

    def _release(self, key: int, entry: list[int]) -> None:
        """A tracked tensor was freed: its storage stops counting with the last of its tensors (at once, so new
        memory at a freed address is never taken for the old)."""
        entry[1] -= 1
        if entry[1] == 0 and self._live.get(key) is entry:
            del self._live[key]
            self._total -= entry[0]


def time_call(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> tuple[float, int]:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs, and the peak extra memory of one run."""
    return time_calls({"fn": fn}, repeats, warmup, device)["fn"]


#: A method faster than this per call is "quick": :func:`time_calls` can run it several times per round.
QUICK_SECONDS = 1.0


def time_calls(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device,
    log: Callable[[str], None] = lambda _: None,
    quick_seconds: float = QUICK_SECONDS,
    quick_passes: int = 1,
) -> dict[str, tuple[float, int]]:
    """Median time in seconds and peak extra memory of one run, for each of ``fns``.

    The methods are interleaved -- every round runs each once -- so that a slow spell of a shared
    machine falls on all of them rather than on one; ``warmup`` untimed runs of each come first.
    Each round starts ``len(fns) // repeats`` methods later than the previous one (at least one), so that no
    method always runs first or right after the same one (e.g. a long SDPA call, or a whole-clip forward that
    leaves the caches cold). A method whose first timed run took under ``quick_seconds`` runs ``quick_passes``
    times per round, in interleaved passes over the quick methods: the slow and
    fast spells of a shared machine last seconds, and one sample per round of a table with a long SDPA
    call would leave a quick method's median to a few of them.
    On CUDA a run is timed by CUDA events around it (device time, no host synchronisation inside the
    timed region); elsewhere by the wall clock.
    """
    cuda = torch.device(device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    peaks: dict[str, int] = {}
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    with torch.no_grad():
        for name, fn in fns.items():
            log(f"{name} ...")
            for _ in range(warmup):
                fn()
            sync()
            with PeakMemory(device) as memory:
                fn()
            peaks[name] = memory.peak
        stride = max(1, len(names) // repeats)  # the rounds start evenly spread over the methods
        for round_ in range(repeats):
            start = round_ * stride % len(names)
            order = names[start:] + names[:start]
            for pass_ in range(max(1, quick_passes)):
                for name in order:
                    if pass_ == 0 or times[name][0] < quick_seconds:
                        fn = fns[name]
                        times[name].append(_cuda_event_seconds(fn, device) if cuda else _wall_seconds(fn))
    return {name: (statistics.median(times[name]), peaks[name]) for name in fns}


def _wall_seconds(fn: Callable[[], object]) -> float:
    """Wall time of one ``fn()`` in seconds."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _cuda_event_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Device time of one ``fn()`` in seconds, between CUDA events recorded before and after it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def _sdpa_backends(device: torch.device, requested: Sequence[str] | None) -> list[str]:
    """Diffusers attention backends to time: ``native`` everywhere, plus flash/xformers on a GPU when they run."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    # PyTorch's own FlashAttention, cuDNN and memory-efficient kernels, flash-attn 2 / 3, xformers
    # (the last usable one is the MHLA rows' cross-attention backend: the likely fastest last)
    gpu = ["_native_efficient", "_native_cudnn", "_native_flash", "flash", "_flash_3", "xformers"]
    names = list(requested) if requested else ["native"] + (gpu if device.type == "cuda" else [])
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


def plain_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Global linear attention ``q (Σ_s k_s v_sᵀ) / (q · Σ_s k_s + eps)`` in three einsums, in the inputs'
    dtype: the plain baseline a user would write (no blocks, no mixing, no regrouping) that MHLA's cost is
    compared with. ``q, k`` feature-mapped ``(B, N, H, D)``, ``v`` ``(B, N, H, Dv)``."""
    kv = torch.einsum("bnhd,bnhe->bhde", k, v)
    z = k.sum(dim=1)
    return torch.einsum("bnhd,bhde->bnhe", q, kv) / (torch.einsum("bnhd,bhd->bnh", q, z).unsqueeze(-1) + eps)


def feature_map(x: torch.Tensor, eps: float) -> torch.Tensor:
    """MHLA's feature map ``ReLU(x) + eps`` as a user writes it for a linear attention: one new tensor."""
    return torch.relu(x).add_(eps)


def _dims(shape: Sequence[int]) -> str:
    """``(21, 30, 52)`` -> ``"21x30x52"``: how the tables write grids and layouts."""
    return "x".join(map(str, shape))


def _timing_rows(
    timings: dict[str, tuple[float, int]],
    grid: Sequence[int],
    layout: str,
    counts: dict[str, int] | None = None,
    milliseconds: bool = False,
) -> list[dict[str, Any]]:
    """One table row per method of ``timings`` (:func:`time_calls`' name -> (median seconds, peak extra
    bytes)), in its order: ``grid``, ``tokens``, ``layout``, the ``counts`` columns (blocks, layers),
    ``method``, ``median_ms`` (``milliseconds``) or ``median_s``, ``peak_extra_mb``. Tables add their
    own columns after these."""
    median = "median_ms" if milliseconds else "median_s"
    return [
        {
            "grid": _dims(grid),
            "tokens": math.prod(grid),
            "layout": layout,
            **(counts or {}),
            "method": name,
            median: seconds * 1e3 if milliseconds else seconds,
            "peak_extra_mb": peak / 2**20,
        }
        for name, (seconds, peak) in timings.items()
    ]


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
    quick_passes: int = 5,
) -> list[dict]:
    """Time SDPA, global linear attention (:func:`plain_linear_attention`, and the MHLA operator with one
    block) and MHLA on the same random inputs for every case, on feature-mapped ``q, k`` and (rows ``+ φ``)
    from raw projections with the feature map included; ``mhla_over_linear`` is MHLA's time over the plain
    linear attention's on the same inputs (on the ``"mhla"`` and ``"mhla + φ"`` rows). ``repeats`` rounds; a method
    under :data:`QUICK_SECONDS` per call runs ``quick_passes`` times per round (see :func:`time_calls`)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    device = torch.device(device)
    backends = _sdpa_backends(device, sdpa_backends)
    rows = []
    inputs: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
    for case in cases:
        if case.grid not in inputs:
            g = torch.Generator().manual_seed(0)
            shape = (1, case.tokens, heads, head_dim)
            inputs = {
                case.grid: tuple(  # one grid's inputs alive at a time: features q, k, values v, projections
                    x.to(device, dtype)
                    for x in (
                        torch.rand(shape, generator=g),
                        torch.rand(shape, generator=g),
                        torch.randn(shape, generator=g),
                        torch.randn(shape, generator=g),
                        torch.randn(shape, generator=g),
                    )
                )
            }
        q, k, v, q_raw, k_raw = inputs[case.grid]
        io_bytes = 4 * q.numel() * q.element_size()  # q, k, v and the output
        ones = (1,) * len(case.grid)
        methods: list[tuple[str, Callable[[], object]]] = []
        if sdpa_max_tokens is None or case.tokens <= sdpa_max_tokens:
            for name in backends:
                backend = AttentionBackendName(name)
                methods.append((f"sdpa ({name})", lambda b=backend: dispatch_attention_fn(q, k, v, backend=b)))
        one = torch.ones(1, 1, device=device, dtype=dtype)
        methods.append(("linear", lambda: plain_linear_attention(q, k, v)))
        methods.append(("linear (MHLA, 1 block)", lambda: mhla_attention(q, k, v, case.grid, ones, one)))
        mixing = mixing_init(case.layout).to(device, dtype)
        # from raw projections, the feature map φ(x) = ReLU(x) + eps included: the processors' path
        eps = MHLAConfig().eps
        methods.append(
            ("linear + φ", lambda: plain_linear_attention(feature_map(q_raw, eps), feature_map(k_raw, eps), v))
        )
        methods.append(
            ("mhla + φ", lambda: mhla_attention(q_raw, k_raw, v, case.grid, case.layout, mixing, feature_eps=eps))
        )
        methods.append(("mhla", lambda: mhla_attention(q, k, v, case.grid, case.layout, mixing)))
        grid = _dims(case.grid)
        timings = time_calls(
            dict(methods), repeats, warmup, device, lambda text: log(f"  {grid} {text}"), quick_passes=quick_passes
        )
        linear, mhla = timings["linear"][0], timings["mhla"][0]
        sdpa = min((t for n, (t, _) in timings.items() if n.startswith("sdpa")), default=None)
        layout = _dims(case.layout) + (" (auto)" if case.auto else "")
        case_rows = _timing_rows(timings, case.grid, layout, {"blocks": num_blocks(case.layout)}, milliseconds=True)
        for row, (_, peak) in zip(case_rows, timings.values()):
            row["extra_vs_io"] = peak / io_bytes
        rows.extend(case_rows)
        rows[-2].update(mhla_over_linear=timings["mhla + φ"][0] / timings["linear + φ"][0])
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

    from ..config import MHLAConfig
    from ..models.processors.grid import TokenGridContext
    from ..models.processors.wan import WanMHLAProcessor

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

    def with_processor(processor: torch.nn.Module) -> Callable[[], object]:
        def forward() -> object:
            block.attn1.set_processor(processor)  # interleaved runs switch the self-attention every call
            return block(hidden, text, temb, rotary)

        return forward

    methods = {"default (sdpa)": with_processor(default_processor), "mhla": with_processor(mhla_processor)}
    timings = time_calls(methods, repeats, warmup, device, lambda text: log(f"  Wan block {text}"))
    rows = _timing_rows(timings, grid, _dims(layout))
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


#: The first columns of every timing table (:func:`_timing_rows`): the case.
_CASE_COLUMNS = (("grid", "grid", ""), ("tokens", "N", ",d"), ("layout", "layout", ""))
ATTENTION_COLUMNS = (
    *_CASE_COLUMNS,
    ("blocks", "M", "d"),
    ("method", "method", ""),
    ("median_ms", "median ms", ".1f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("extra_vs_io", "extra / (q,k,v,out)", ".2f"),
    ("sdpa_over_mhla", "SDPA / MHLA", ".1f"),
    ("mhla_over_linear", "MHLA / linear", ".2f"),
)
BLOCK_COLUMNS = (
    *_CASE_COLUMNS,
    ("method", "self-attention", ""),
    ("median_s", "median s", ".2f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("sdpa_over_mhla", "SDPA / MHLA", ".2f"),
)


def _cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``model``'s floating-point parameters and buffers to ``dtype`` except those of the modules
    Diffusers keeps in float32 when loading (``_keep_in_fp32_modules``: Wan's RoPE, time embedder,
    norms, modulation), as ``from_pretrained(torch_dtype=dtype)`` does."""
    from ..loaders.weight_files import dtype_on_load

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype_on_load(model, name, dtype))
    return model


TRANSFORMER_COLUMNS = (
    *_CASE_COLUMNS,
    ("layers", "blocks", "d"),
    ("method", "self-attention", ""),
    ("median_s", "median s", ".3f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("sdpa_over_mhla", "SDPA / MHLA", ".2f"),
)


def wan_transformer_table(
    grid: tuple[int, int, int],
    layout: tuple[int, int, int] | None = None,
    layers: int = 4,
    dim: int = 1536,
    heads: int = 12,
    ffn_dim: int = 8960,
    text_tokens: int = 512,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    warmup: int = 1,
    sdpa_backends: Sequence[str] | None = None,
    log: Callable[[str], None] = lambda _: None,
    settings: dict[str, "MHLAConfig"] | None = None,
) -> list[dict]:
    """Time a whole Wan2.1-1.3B-shaped transformer forward with ``layers`` blocks: stock, once per usable
    SDPA backend, and converted to MHLA (every block; cross-attention on the last usable backend). The
    stock runs are the converted model under :func:`~mhla_diffusion.models.conversion.softmax_attention`
    (the same weights), interleaved with the MHLA runs (:func:`time_calls`).

    ``settings`` names the MHLA settings to convert to in turn (their ``layers`` and ``layout`` replaced
    by every block and ``layout``); default ``{"mhla": MHLAConfig()}``. The stock runs are interleaved
    with the first setting's.

    The model is Wan2.1-T2V-1.3B's config (``dim``, ``heads``, ``ffn_dim`` and ``layers`` replaced) with
    random weights, built on ``device``; inputs are latents ``(1, 16, F, 2 H, 2 W)`` for the token grid
    ``(F, H, W)`` and ``text_tokens`` text embeddings ``(1, T, 4096)``. The MHLA rows (last) carry
    ``sdpa_over_mhla``: the fastest stock row's time over theirs. Every row has ``weights_mb``, the
    model's parameters and buffers (stock), which ``peak_extra_mb`` does not include.
    """
    from diffusers import WanTransformer3DModel

    from ..config import MHLAConfig
    from ..models.conversion import convert_to_mhla, revert_mhla, softmax_attention
    from ..utils.wan_configs import wan_transformer_config

    device = torch.device(device)
    layout = tuple(layout or auto_layout(grid))
    backends = _sdpa_backends(device, sdpa_backends)
    config = wan_transformer_config("Wan2.1-T2V-1.3B")
    config.update(num_layers=layers, num_attention_heads=heads, attention_head_dim=dim // heads, ffn_dim=ffn_dim)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: no host copy of the weights
        model = _cast_like_from_pretrained(WanTransformer3DModel(**config).eval(), dtype)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    patch = config["patch_size"]
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, config["in_channels"], *(n * p for n, p in zip(grid, patch)), generator=g)
    text = torch.randn(1, text_tokens, config["text_dim"], generator=g)
    inputs = dict(
        hidden_states=latents.to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=text.to(device, dtype),
        return_dict=False,
    )

    def forward(backend: str, stock: bool) -> Callable[[], object]:
        def run() -> object:
            with softmax_attention(model) if stock else nullcontext():
                model.set_attention_backend(backend)  # the SDPA layers' backend (MHLA processors have none)
                return model(**inputs)

        return run

    label = f"  Wan transformer ({layers} blocks)"
    timings: dict[str, tuple[float, int]] = {}
    for i, (setting, mhla_config) in enumerate((settings or {"mhla": MHLAConfig()}).items()):
        if i:
            revert_mhla(model)
        # processors on the model's device and dtype
        convert_to_mhla(model, dataclasses.replace(mhla_config, layers="all", layout=layout))
        methods = {f"sdpa ({name})": forward(name, stock=True) for name in backends} if i == 0 else {}
        methods[setting] = forward(backends[-1], stock=False)
        timings.update(time_calls(methods, repeats, warmup, device, lambda text: log(f"{label} {text}")))
    stock = [name for name in timings if name.startswith("sdpa (")]
    rows = _timing_rows(timings, grid, _dims(layout), {"layers": layers})
    fastest_stock = min(timings[name][0] for name in stock)
    for row, (name, (seconds, _)) in zip(rows, timings.items()):
        row["weights_mb"] = weights / 2**20
        if name not in stock:
            row["method"] = f"{name} (cross-attention {backends[-1]})"
            row["sdpa_over_mhla"] = fastest_stock / seconds
    return rows


@dataclass
class BenchSpec:
    """Everything one ``mhla bench`` measurement needs; plain values, so a fresh process can get it as JSON.

    ``cases`` holds ``(grid, layout or None for auto)`` pairs of the operator table. The Wan block table
    runs when ``block_grid`` is set, the Wan transformer table when ``transformer_layers > 0`` (on the
    same grid, layout and width). ``malloc`` is one of :data:`MALLOC_MODES` (CPU only).
    """

    cases: list[tuple[tuple[int, ...], tuple[int, ...] | None]]
    heads: int = 12
    head_dim: int = 128
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    quick_passes: int = 5
    warmup: int = 1
    sdpa_backends: list[str] | None = None
    sdpa_max_tokens: int | None = None
    block_grid: tuple[int, int, int] | None = (21, 30, 50)
    block_layout: tuple[int, int, int] | None = None
    block_dim: int = 1536
    block_heads: int = 12
    block_ffn: int = 8960
    block_text_tokens: int = 512
    transformer_layers: int = 0
    malloc: str = "auto"
    threads: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BenchSpec":
        """The spec of :meth:`to_json`'s output (lists back to tuples)."""
        data = dict(data)
        tuple_or_none = lambda x: None if x is None else tuple(x)  # noqa: E731
        data["cases"] = [(tuple(grid), tuple_or_none(layout)) for grid, layout in data["cases"]]
        data["block_grid"] = tuple_or_none(data.get("block_grid"))
        data["block_layout"] = tuple_or_none(data.get("block_layout"))
        data.setdefault("quick_passes", 1)  # runs saved before the option timed every method once per round
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (tuples become lists)."""
        return asdict(self)


def _where(spec: BenchSpec, device: torch.device, fresh_process: bool) -> str:
    """The machine line of a result: GPU name, or CPU, threads and how the allocator was set."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ..ops.cpu_memory import malloc_retained

    malloc = {
        "auto": "the library's own malloc setting",
        "default": "glibc malloc defaults (MHLA_KEEP_MALLOC=1)",
        "retain": "retain_freed_memory() first",
    }[spec.malloc]
    process = "fresh process" if fresh_process else "in-process"
    kept = "keeps freed memory" if malloc_retained() else "returns freed memory"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, {process}, {malloc} (at the end: {kept})"


def measure(
    spec: BenchSpec, log: Callable[[str], None] = lambda _: None, fresh_process: bool = False
) -> dict[str, Any]:
    """Run the tables of ``spec`` in this process; a JSON-ready dict with the spec, the machine and the rows.

    ``fresh_process`` only labels the result (:func:`measure_in_fresh_process` sets it); in a process
    that already ran other work, ``spec.malloc`` names the wish, not necessarily the allocator's state,
    which the result's ``device`` line reports as it was at the end.
    """
    device = torch.device(spec.device)
    dtype = getattr(torch, spec.dtype)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if device.type == "cpu" and spec.malloc == "retain":
        from ..ops.cpu_memory import retain_freed_memory

        retain_freed_memory()
    cases = [BenchCase.of(grid, layout) for grid, layout in spec.cases]
    rows = attention_table(
        cases,
        spec.heads,
        spec.head_dim,
        dtype,
        device,
        spec.repeats,
        spec.warmup,
        spec.sdpa_backends,
        spec.sdpa_max_tokens,
        log,
        spec.quick_passes,
    )
    block_rows, transformer_rows = [], []
    if spec.block_grid is not None:
        wan = dict(  # the Wan shape and the run settings both Wan tables take
            layout=spec.block_layout,
            dim=spec.block_dim,
            heads=spec.block_heads,
            ffn_dim=spec.block_ffn,
            text_tokens=spec.block_text_tokens,
            dtype=dtype,
            device=device,
            repeats=spec.repeats,
            log=log,
        )
        block_rows = wan_block_table(spec.block_grid, warmup=0, **wan)
        if spec.transformer_layers > 0:
            transformer_rows = wan_transformer_table(
                spec.block_grid, layers=spec.transformer_layers, warmup=1, sdpa_backends=spec.sdpa_backends, **wan
            )
    return {
        "spec": spec.to_json(),
        "device": _where(spec, device, fresh_process),
        "device_type": device.type,
        "dtype": spec.dtype,
        "torch": torch.__version__,
        "attention": rows,
        "wan_block": block_rows,
        "wan_transformer": transformer_rows,
    }


def measure_in_fresh_process(spec: Any, module: str = "mhla_diffusion.benchmarks.bench") -> dict[str, Any]:
    """:func:`measure` in a new Python process (progress on this stderr), with the allocator of ``spec.malloc``
    (``spec``: a :class:`BenchSpec`, or a ``StreamSpec`` of :mod:`~mhla_diffusion.benchmarks.stream`).

    ``default`` sets ``MHLA_KEEP_MALLOC=1`` there; ``auto`` and ``retain`` clear it, so that a value in
    this process's environment does not change what the mode measures. ``module`` is the module run there
    with the spec's JSON (``python -m module '<spec>'``, printing the result's JSON last): this one, or
    :mod:`~mhla_diffusion.benchmarks.stream` for a ``StreamSpec``.
    """
    from ..ops.cpu_memory import KEEP_MALLOC_ENV

    if spec.malloc not in MALLOC_MODES:
        raise ValueError(f"`malloc` must be one of {MALLOC_MODES}, got {spec.malloc!r}")
    env = dict(os.environ)
    env.pop(KEEP_MALLOC_ENV, None)
    if spec.malloc == "default":
        env[KEEP_MALLOC_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-m", module, json.dumps(spec.to_json())],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark process failed (exit code {done.returncode}); its error is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_in_fresh_processes(
    spec: BenchSpec, processes: int, log: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """:func:`measure_in_fresh_process` ``processes`` times, one process after the other, combined by
    :func:`combine_processes`: one process shows one draw of what the machine gives a process (on a virtual
    machine, e.g., whether the threads' cores share a cache), several show the spread."""
    if processes < 1:
        raise ValueError(f"`processes` must be >= 1, got {processes}")
    results = []
    for i in range(processes):
        log(f"fresh process {i + 1} of {processes}")
        results.append(measure_in_fresh_process(spec))
    return combine_processes(results)


#: Per-row ratios that :func:`combine_processes` takes the median of (and lists per process for MHLA / linear).
_RATIO_KEYS = ("mhla_over_linear", "sdpa_over_mhla")


def combine_processes(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from :func:`measure` results of the same spec, each measured in its own fresh process.

    Every table row keeps its place. Its median time is the median over the processes of that row's
    per-process medians, and its peak memory is the largest. ``mhla_over_linear`` and ``sdpa_over_mhla``
    are the medians of the per-process ratios. ``processes`` adds ``count`` and, for every operator row with
    an MHLA / linear ratio, ``mhla_over_linear``: that row's ``grid``, ``tokens``, ``layout``, ``method``,
    ``per_process`` ratios and ``per_process_ms``, their ``median``, ``min`` and ``max``, and ``spread``
    (max / min). A single result comes back with that section too."""
    if not results:
        raise ValueError("combine_processes needs at least one result")
    first = results[0]
    tables = ("attention", "wan_block", "wan_transformer")
    for other in results[1:]:
        for table in tables:
            mine, theirs = first.get(table) or [], other.get(table) or []
            if [_row_key(r) for r in mine] != [_row_key(r) for r in theirs]:
                raise ValueError(f"the processes' {table} tables have different rows: not the same spec")
    combined = {**first, "device": f"{first['device']}; {len(results)} fresh processes, medians across them"}
    for table in tables:
        rows = []
        for i, row in enumerate(first.get(table) or []):
            same = [r[table][i] for r in results]
            row = dict(row)
            for key in ("median_ms", "median_s", *_RATIO_KEYS):
                values = [r[key] for r in same if r.get(key) is not None]
                if key in row and values:
                    row[key] = statistics.median(values)
            for key in ("peak_extra_mb", "extra_vs_io"):
                if key in row:
                    row[key] = max(r[key] for r in same)
            rows.append(row)
        combined[table] = rows
    spreads = []
    for i, row in enumerate(first["attention"]):
        if "mhla_over_linear" not in row:
            continue
        ratios = [r["attention"][i]["mhla_over_linear"] for r in results]
        spreads.append(
            {
                **{key: row[key] for key in ("grid", "tokens", "layout", "method")},
                "per_process": ratios,
                "per_process_ms": [r["attention"][i]["median_ms"] for r in results],
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "spread": max(ratios) / min(ratios),
            }
        )
    combined["processes"] = {"count": len(results), "mhla_over_linear": spreads}
    return combined


def _row_key(row: dict[str, Any]) -> tuple:
    """What identifies a table row across processes."""
    return row.get("grid"), row.get("layout"), row.get("method"), row.get("layers")


PROCESS_COLUMNS = (
    ("grid", "grid", ""),
    ("layout", "layout", ""),
    ("method", "method", ""),
    ("ratios", "MHLA / linear, each process", ""),
    ("median", "median", ".2f"),
    ("min", "min", ".2f"),
    ("max", "max", ".2f"),
    ("spread", "max / min", ".2f"),
)


def process_table(result: dict[str, Any]) -> str:
    """The ``processes`` section of a :func:`combine_processes` result as a Markdown table."""
    rows = [
        {**row, "ratios": " ".join(f"{x:.2f}" for x in row["per_process"])}
        for row in result["processes"]["mhla_over_linear"]
    ]
    return format_table(rows, PROCESS_COLUMNS)


def _samples(spec: dict[str, Any]) -> str:
    """How many runs each median of a saved spec covers."""
    passes = spec.get("quick_passes", 1)
    if passes <= 1:
        return f"median of {spec['repeats']}"
    runs = spec["repeats"] * passes
    return f"median of {spec['repeats']} rounds ({runs} runs for operators under {QUICK_SECONDS:g} s per call)"


def report_markdown(result: dict[str, Any]) -> str:
    """The tables of a :func:`measure` result (or its saved JSON) as Markdown, with a header line."""
    missing = {"spec", "device", "device_type", "dtype", "torch", "attention"} - set(result)
    if missing:
        raise ValueError(f"not a result of `mhla bench --output` (missing {sorted(missing)}); measure again")
    spec = result["spec"]
    lines = [
        f"`mhla bench` on {result['device']}, {result['dtype']}, torch {result['torch']}, {_samples(spec)}.",
        "",
        f"Attention operator, B=1, H={spec['heads']}, D={spec['head_dim']}:",
        "",
        format_table(result["attention"], ATTENTION_COLUMNS),
    ]
    if result.get("wan_block"):
        lines += [
            "",
            f"One Wan transformer block (dim {spec['block_dim']}, {spec['block_heads']} heads, ffn "
            f"{spec['block_ffn']}, cross-attention to {spec['block_text_tokens']} text tokens):",
            "",
            format_table(result["wan_block"], BLOCK_COLUMNS),
        ]
    if result.get("wan_transformer"):
        layers = spec["transformer_layers"]
        lines += [
            "",
            f"Whole Wan2.1-1.3B-shaped transformer forward, {layers} block{'s' * (layers != 1)} (dim "
            f"{spec['block_dim']}, {spec['block_text_tokens']} text tokens), stock per SDPA backend and "
            "converted to MHLA:",
            "",
            format_table(result["wan_transformer"], TRANSFORMER_COLUMNS),
        ]
    if result.get("processes"):
        count = result["processes"]["count"]
        lines += [
            "",
            f"MHLA / linear attention in each of {count} fresh process{'es' * (count != 1)} (the same case, "
            "measured again from the start in a new Python process):",
            "",
            process_table(result),
        ]
    return "\n".join(lines)


def replace_marked_section(text: str, name: str, body: str) -> str:
    """``text`` with what lies between ``<!-- mhla-bench:NAME -->`` and ``<!-- /mhla-bench:NAME -->`` replaced
    by ``body`` (the markers stay); ``ValueError`` when the pair is missing or appears more than once."""
    start, end = f"<!-- mhla-bench:{name} -->", f"<!-- /mhla-bench:{name} -->"
    pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected exactly one section between {start} and {end} (each on its own line)")
    return pattern.sub(lambda _: f"{start}\n{body.strip()}\n{end}", text)


if __name__ == "__main__":  # the fresh measuring process: python -m mhla_diffusion.benchmarks.bench '<spec json>'
    _spec = BenchSpec.from_json(json.loads(sys.argv[1]))
    _result = measure(_spec, lambda text: print(text, file=sys.stderr, flush=True), fresh_process=True)
    print(json.dumps(_result))
