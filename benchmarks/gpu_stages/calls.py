"""The attention calls every timing stage builds (operator, Wan processor path, fused kernel), their counted bytes,
and the profiler's kernel counts."""

from __future__ import annotations

import collections
import math
from typing import Callable

import torch

from mhla_diffusion.benchmarks.attention_traffic import (
    wan_rotary_tables,
    wan_self_attention,
)
from mhla_diffusion.benchmarks.bench import plain_linear_attention

from .common import FUSED_KERNEL_MARKS, LoopPlan, Sizes, StageContext, _dot_dtype, _grid_label
from .environment import fa3_status, settings


def operator_calls(
    grid: tuple[int, ...], sizes: Sizes, device: torch.device | str, dtype: torch.dtype
) -> dict[str, Callable]:
    """The MHLA operator's timed calls on ``grid`` (random inputs; empty ones on ``meta``, for counting bytes).

    Features are given in ``dtype`` (computed once, outside the timed call) except on the processor rows,
    which start from projected ``q, k, v`` as a Wan layer does."""
    from mhla_diffusion.models.processors.base import apply_interleaved_rotary
    from mhla_diffusion.ops.attention import mhla_attention
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.mixing import mixing_init

    device = torch.device(device)
    n, layout = math.prod(grid), sizes.layout
    shape = (1, n, sizes.heads, sizes.head_dim)
    if device.type == "meta":
        qf, kf, v = (torch.empty(shape, device=device, dtype=dtype) for _ in range(3))
        cos, sin = (torch.empty(1, n, 1, sizes.head_dim, device=device) for _ in range(2))
    else:
        g = torch.Generator().manual_seed(0)
        qf, kf = (torch.rand(shape, generator=g).to(device, dtype) for _ in range(2))  # non-negative features
        v = torch.randn(shape, generator=g).to(device, dtype)
        cos, sin = wan_rotary_tables(grid, sizes.head_dim, device)
    q_rot, k_rot = (apply_interleaved_rotary(x, cos, sin) for x in (qf, kf))
    plan = block_plan(grid, layout, device)
    mixing = mixing_init(layout).to(device)
    calls = {
        "MHLA operator, plan per call": lambda: mhla_attention(qf, kf, v, grid, layout, mixing),
        "MHLA operator, plan precomputed": lambda: mhla_attention(qf, kf, v, grid, layout, mixing, plan=plan),
        "MHLA operator + RoPE, plan precomputed": lambda: mhla_attention(
            qf, kf, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, plan=plan
        ),
        "plain linear attention (einsum)": lambda: plain_linear_attention(qf, kf, v),
    }
    for setting, config in settings(layout).items():
        _, call = wan_self_attention(
            grid, config, heads=sizes.heads, head_dim=sizes.head_dim, dtype=dtype, device=device
        )
        calls[f"Wan processor path, {setting} (feature map, RoPE{', norm, gate' if config.gate else ''})"] = call
    return calls


#: The rows timed again with TF32 matmuls (the operator accumulates bf16 inputs in float32 products).
TF32_ROWS = ("MHLA operator, plan precomputed", "Wan processor path, paper", "Wan processor path, released")


#: The rows that compute MHLA, whose bytes have MHLA's floor (:func:`~mhla_diffusion.ops.traffic.floor_bytes`).
MHLA_ROWS = ("MHLA operator", "Wan processor path", "fused Triton kernel")


def _at_precision(fn: Callable[[], object], tf32: bool) -> Callable[[], object]:
    def run() -> object:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        return fn()

    return run


def counted_bytes(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, fused: bool = False) -> dict[str, int]:
    """Bytes read and written by every call of :func:`operator_calls`, counted on meta tensors; with ``fused``
    (the fused kernels run on the timing device, so the processors take them) the processor rows' kernels
    counted from their launch."""
    from mhla_diffusion.benchmarks.attention_traffic import count_path

    calls = operator_calls(grid, sizes, "meta", dtype)
    return {name: sum(size for _, size in count_path(call, fused)[0].values()) for name, call in calls.items()}


def fused_bytes(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, normalize: str) -> int:
    """Bytes of one call of :func:`_fused_calls`'s kernel, counted from its launch."""
    return sum(fused_terms(grid, sizes, dtype, normalize).values())


def fused_dram_bytes(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, normalize: str) -> int:
    """:func:`fused_bytes` less what a GPU's L2 serves (the RoPE angle plan and slot indices every head reads again:
    :func:`~mhla_diffusion.ops.traffic.dram_estimate`)."""
    from mhla_diffusion.ops.traffic import dram_estimate

    return dram_estimate(fused_terms(grid, sizes, dtype, normalize), sizes.heads)[0]


def fused_terms(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, normalize: str) -> dict[str, int]:
    """The launch's counted terms (:func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`)."""
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.triton_mhla import fused_traffic

    plan = block_plan(grid, sizes.layout)
    return dict(
        fused_traffic(
            1,
            math.prod(grid),
            sizes.heads,
            sizes.head_dim,
            sizes.head_dim,
            plan.num_blocks,
            plan.block_len,
            padded=plan.valid is not None,
            dtype=dtype,
            normalize=normalize,
        )
    )


def _fused_calls(
    fused: Callable, grid: tuple[int, ...], sizes: Sizes, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable]:
    """The fused kernel from projected ``q, k`` (feature map and RoPE inside), both normalisations."""
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.mixing import mixing_init

    n = math.prod(grid)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, sizes.heads, sizes.head_dim, generator=g).to(device, dtype) for _ in range(3))
    cos, sin = wan_rotary_tables(grid, sizes.head_dim, device)
    plan, mixing = block_plan(grid, sizes.layout, device), mixing_init(sizes.layout).to(device)
    return {
        _fused_name(mode): (
            lambda mode=mode: fused(q, k, v, plan, mixing, cos=cos, sin=sin, normalize=mode, dot_dtype=_dot_dtype())
        )
        for mode in FUSED_MODES
    }


#: The fused kernel's timed normalisations.
FUSED_MODES = ("denominator", "none")


def _fused_name(mode: str) -> str:
    return f"fused Triton kernel, {mode} (feature map, RoPE)"


# ----------------------------------------------------------------------------- profiler helpers


def kernel_counts(call: Callable[[], object], device: torch.device, limit: int = 20) -> dict[str, int]:
    """The device kernels one ``call`` launches, ``{name: launches}``, most launched first (names cut to 90
    characters, at most ``limit``). Off CUDA ``call`` runs once and the answer is ``{}``."""
    if device.type != "cuda":
        call()
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name[:90]] += 1
    return dict(counts.most_common(limit))


def fused_launches(kernels: dict[str, int]) -> int:
    """Launches of the fused MHLA kernels among ``kernels`` (:data:`FUSED_KERNEL_MARKS` in the name)."""
    return sum(n for name, n in kernels.items() if any(mark in name for mark in FUSED_KERNEL_MARKS))


def loop_stage_entry(ctx: StageContext, plan: LoopPlan, **paths: str) -> dict:
    """What a timing stage's entry starts with (the timing and training stages): no rows yet, the dtype, heads,
    head dim and block layout of the sizes, the loops' repeats and timer, ``paths`` (the fused paths' status) and
    FlashAttention-3's."""
    sizes = ctx.sizes
    return dict(
        rows=[],
        dtype=str(ctx.dtype).removeprefix("torch."),
        heads=sizes.heads,
        head_dim=sizes.head_dim,
        layout=_grid_label(sizes.layout),
        repeats=plan.repeats,
        timer=ctx.timer.name,
        **paths,
        fa3=fa3_status(),
    )
