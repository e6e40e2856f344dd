"""The ``timing`` stage: attention forwards at the paper's grids against SDPA and a plain linear attention."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from . import environment
from .calls import (
    MHLA_ROWS,
    TF32_ROWS,
    _at_precision,
    _fused_calls,
    _fused_name,
    counted_bytes,
    fused_bytes,
    fused_dram_bytes,
    loop_stage_entry,
    operator_calls,
)
from .common import Sizes, StageContext, _error_line, _grid_label, cuda_graph_replay, time_loops
from .environment import attention_baselines


def attention_calls(
    grid: tuple[int, ...], sizes: Sizes, device: torch.device, dtype: torch.dtype, fused: Callable | None, tf32: bool
) -> tuple[dict[str, Callable[[], object]], dict[str, int], dict[str, str], dict[str, str]]:
    """Every attention forward the timing stage times on ``grid``: ``(calls, bytes of each call, what those
    bytes are, {method: why it does not run})``. The MHLA operator and processor rows (:func:`operator_calls`;
    again with TF32 matmuls when ``tf32``), SDPA and FlashAttention (:func:`attention_baselines`), and last the
    fused kernel when ``fused`` is given (a fault in the new kernel then loses only its own rows)."""
    n = math.prod(grid)
    unit = n * sizes.heads * sizes.head_dim * torch.empty((), dtype=dtype).element_size()
    bytes_of = counted_bytes(grid, sizes, dtype, fused=fused is not None)
    plain = operator_calls(grid, sizes, device, dtype)
    calls = {name: _at_precision(call, False) for name, call in plain.items()}
    basis = dict.fromkeys(calls, "counted")
    if tf32:
        for name in [c for c in plain if c.startswith(TF32_ROWS)]:
            calls[f"{name}, TF32"] = _at_precision(plain[name], True)
            bytes_of[f"{name}, TF32"], basis[f"{name}, TF32"] = bytes_of[name], "counted"
    g = torch.Generator().manual_seed(1)
    heads_first = [torch.randn(1, sizes.heads, n, sizes.head_dim, generator=g).to(device, dtype) for _ in range(3)]
    tokens_first = [t.transpose(1, 2).contiguous() for t in heads_first]
    baselines, errors = attention_baselines(heads_first, tokens_first, sizes)
    for name, call in baselines.items():
        calls[name] = _at_precision(call, False)
        bytes_of[name], basis[name] = 4 * unit, "q, k, v, out once"
    if fused is not None:
        for name, call in _fused_calls(fused, grid, sizes, device, dtype).items():
            calls[name] = call
            mode = name.split(", ")[1].split()[0]
            bytes_of[name], basis[name] = fused_bytes(grid, sizes, dtype, mode), "counted from the launch"
            bytes_of[f"{name}, DRAM"] = fused_dram_bytes(grid, sizes, dtype, mode)
    return calls, bytes_of, basis, errors


#: The rows the timing stage times first on each grid (and saves), before the rest: what a reader looks for.
HEADLINE_ROWS = ("SDPA flash", "SDPA cuDNN", "Wan processor path, paper", _fused_name("denominator"))


def headline_first(names: list[str]) -> tuple[list[str], list[str]]:
    """``names`` split into the headline rows (:data:`HEADLINE_ROWS`, by prefix) and the rest, each in order."""
    headline = [name for name in names if name.startswith(HEADLINE_ROWS)]
    return headline, [name for name in names if name not in headline]


def stage_timing(ctx: StageContext) -> None:
    """Device time of every attention forward on each timing grid (loops of calls), GB/s against the counted
    bytes; the headline rows (:data:`HEADLINE_ROWS`) of a grid are timed first and saved before its other rows,
    so a stage cut short keeps them; then (CUDA) every timed call again as CUDA graph replays, after all grids'
    loops, so that a capture that upsets the device costs only graph columns."""
    from mhla_diffusion.ops.traffic import floor_bytes

    sizes, device, dtype = ctx.sizes, ctx.device, ctx.dtype
    plan = sizes.attention_loops
    ctx.data.update(loop_stage_entry(ctx, plan))
    fused, ctx.data["fused"] = environment.fused_kernel()
    tf32 = ctx.cuda_only("the TF32 rows")
    graphs = ctx.cuda_only("the CUDA graph replays")
    fused = fused if ctx.fused_runs(fused, "the fused Triton kernel's rows") else None
    timed: dict[tuple[int, ...], dict[str, dict[str, Any]]] = {}
    for grid in sizes.timing_grids:
        n, label = math.prod(grid), _grid_label(grid)
        unit = n * sizes.heads * sizes.head_dim * torch.empty((), dtype=dtype).element_size()
        floor = floor_bytes(1, n, sizes.heads, sizes.head_dim, sizes.head_dim, math.prod(sizes.layout), dtype)
        calls, bytes_of, basis, errors = attention_calls(grid, sizes, device, dtype, fused, tf32)
        timed[grid] = {}
        for group in headline_first(list(calls)):
            if not group:
                continue
            with torch.no_grad():
                timings, failed = time_loops({name: calls[name] for name in group}, ctx.timer, plan, ctx.log)
            errors.update(failed)
            torch.set_float32_matmul_precision("highest")
            _timing_rows(ctx, calls, timings, timed[grid], label, n, unit, floor, bytes_of, basis)
            ctx.save()
        for name, error in errors.items():
            ctx.data["rows"].append({"grid": label, "tokens": n, "method": name, "median_ms": None, "error": error})
        ctx.data.setdefault("floor_units", {})[label] = floor / unit
        ctx.save()
        del calls
    if not graphs:
        return
    _graph_replays(ctx, timed, sizes, device, dtype, fused, tf32, plan)


def _timing_rows(
    ctx: StageContext,
    calls: dict[str, Callable[[], object]],
    timings: dict[str, Any],
    timed: dict[str, dict[str, Any]],
    label: str,
    n: int,
    unit: int,
    floor: int,
    bytes_of: dict[str, int],
    basis: dict[str, str],
) -> None:
    """One timing row per timed method (its peak memory measured by one more call), into ``ctx`` and ``timed``."""
    from mhla_diffusion.benchmarks.bench import PeakMemory

    for name, timing in timings.items():
        seconds = timing.per_call_s
        with torch.no_grad(), PeakMemory(ctx.device) as memory:
            calls[name]()
        torch.set_float32_matmul_precision("highest")
        row = {
            "grid": label,
            "tokens": n,
            "method": name,
            "calls": timing.calls,
            "median_ms": seconds * 1e3,
            "spread": timing.spread,
            "counted_units": bytes_of[name] / unit,
            "bytes_basis": basis[name],
            "gb_per_s": bytes_of[name] / seconds / 1e9,
            "dram_units": bytes_of[f"{name}, DRAM"] / unit if f"{name}, DRAM" in bytes_of else None,
            "dram_gb_per_s": bytes_of[f"{name}, DRAM"] / seconds / 1e9 if f"{name}, DRAM" in bytes_of else None,
            "floor_gb_per_s": floor / seconds / 1e9 if name.startswith(MHLA_ROWS) else None,
            "peak_extra_mb": memory.peak / 2**20,
        }
        timed[name] = row
        ctx.data["rows"].append(row)


def _graph_replays(ctx, timed, sizes, device, dtype, fused, tf32, plan) -> None:
    """The timed calls replayed from a CUDA graph: device time without the host's launches."""
    replay_plan = dataclasses.replace(plan, repeats=max(3, plan.repeats // 2), warmup=1)
    for grid, rows in timed.items():
        calls = attention_calls(grid, sizes, device, dtype, fused, tf32)[0]
        for name, row in rows.items():
            try:
                replay = cuda_graph_replay(calls[name], device)
                graph_timing, graph_errors = time_loops({name: replay}, ctx.timer, replay_plan)
                if name in graph_timing:
                    row["graph_ms"] = graph_timing[name].per_call_s * 1e3
                else:
                    row["graph_error"] = graph_errors[name]
            except Exception as error:
                row["graph_error"] = _error_line(error)
            replay = None
            torch.set_float32_matmul_precision("highest")
        ctx.save()
        del calls
