"""The ``profile`` and ``families`` stages: the profiler's kernel table and the other Diffusers families' paths."""

from __future__ import annotations

from typing import Callable

import torch

from mhla_diffusion.benchmarks.attention_traffic import (
    wan_self_attention,
)

from . import environment
from .calls import _fused_calls
from .common import StageContext
from .environment import settings


def profile_table(call: Callable[[], object], device: torch.device, rows: int = 15) -> str:
    """torch.profiler's table of one ``call`` (after three untimed ones), busiest ops first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with torch.no_grad():
        for _ in range(3):
            call()
        if cuda:
            torch.cuda.synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            call()
            if cuda:
                torch.cuda.synchronize(device)
    averages = prof.key_averages()
    for key in ["cuda_time_total", "device_time_total"] if cuda else ["cpu_time_total"]:
        try:
            return averages.table(sort_by=key, row_limit=rows)
        except Exception:  # the key's name changed between PyTorch versions
            continue
    return averages.table(row_limit=rows)


def stage_profile(ctx: StageContext) -> None:
    """The profiler's table of one Wan processor call (paper setting) on the first timing grid, and of the fused
    kernel."""
    sizes, grid = ctx.sizes, ctx.sizes.timing_grids[0]
    config = settings(sizes.layout)["paper"]
    _, call = wan_self_attention(
        grid, config, heads=sizes.heads, head_dim=sizes.head_dim, dtype=ctx.dtype, device=ctx.device
    )
    ctx.data["grid"] = "x".join(map(str, grid))
    ctx.data["tables"] = {"Wan processor path, paper": profile_table(call, ctx.device)}
    ctx.save()
    fused, status = environment.fused_kernel()
    ctx.data["fused"] = status
    if ctx.fused_runs(fused, "the fused kernel's profile"):
        name, call = next(iter(_fused_calls(fused, grid, sizes, ctx.device, ctx.dtype).items()))
        ctx.data["tables"][name] = profile_table(call, ctx.device)


def stage_families(ctx: StageContext) -> None:
    """Each model family's self-attention at its published size (``mhla bench --families``): SDPA, global linear
    attention and MHLA (joint with the text block for HunyuanVideo, CogVideoX and Flux), bf16, one call each per
    round (smoke: 2 heads of 8 on tiny grids)."""
    from mhla_diffusion.benchmarks.families import FAMILY_MODELS, family_attention_table

    tiny = {"flux": (4, 6)}
    grids = {name: tiny.get(name, (2, 4, 4)) for name in FAMILY_MODELS} if ctx.smoke else None
    small = dict(heads=2, head_dim=8) if ctx.smoke else {}
    ctx.data["repeats"] = repeats = 1 if ctx.smoke else 3
    ctx.data["dtype"] = str(ctx.dtype).removeprefix("torch.")
    ctx.data["rows"] = []
    for name in FAMILY_MODELS:  # one family at a time, saved as it comes
        if ctx.left() < 5:
            ctx.data.setdefault("notes", []).append(f"stopped before {name}: the stage's time ran out")
            break
        rows = family_attention_table(
            [name], grids, dtype=ctx.dtype, device=ctx.device, repeats=repeats, warmup=1, **small
        )
        ctx.data["rows"] += rows
        ctx.save()
