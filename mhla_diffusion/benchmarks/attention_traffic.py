"""``mhla bench --traffic``: the bytes one MHLA self-attention call of Wan2.1-1.3B moves, counted op by op on meta
tensors (:mod:`mhla_diffusion.ops.traffic`), eager and fused, forward and forward + backward, in the paper's and the
released setting; and the Wan self-attention and RoPE tables the benchmarks build (:func:`wan_self_attention`,
:func:`wan_rotary_tables`; :func:`rotary_tables`: random ones). The command line is :mod:`mhla_diffusion.cli.bench`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..config import MHLAConfig
from ..ops.attention import mhla_attention
from ..ops.block_layout import num_blocks
from .bench import _dims

if TYPE_CHECKING:
    from ..models.processors.wan import WanMHLAProcessor

#: Wan2.1-1.3B's self-attention: 12 heads of 128 channels.
WAN_13B_HEADS, WAN_13B_HEAD_DIM = 12, 128

TRAFFIC_COLUMNS = (
    ("grid", "grid", ""),
    ("tokens", "N", ",d"),
    ("setting", "setting", ""),
    ("layout", "layout", ""),
    ("blocks", "M", "d"),
    ("path", "path", ""),
    ("gigabytes", "GB moved", ".2f"),
    ("units", "U", ".1f"),
    ("floor_units", "floor U", ".1f"),
    ("over_floor", "x floor", ".1f"),
)


#: The paths ``mhla bench --traffic`` counts: the eager operator op by op, and the fused Triton kernels as
#: launched (:func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`) with the processor's ops around them.
TRAFFIC_PATHS = ("eager PyTorch", "fused Triton (counted from the launch)")


def traffic_settings() -> dict[str, "MHLAConfig"]:
    """The settings ``mhla bench --traffic`` counts: the paper's (denominator, nothing around it) and the
    released Wan-MHLA one (no denominator, per-head output RMSNorm, SiLU gate), both on 3x5x10 blocks."""
    from ..config import MHLAConfig

    return {"paper": MHLAConfig(layout=(3, 5, 10)), "released": MHLAConfig.released_wan()}


def rotary_tables(
    tokens: int, head_dim: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random RoPE tables of the layout Diffusers' Wan gives its processors: ``cos`` and ``sin``
    ``(1, N, 1, D)`` float32, each angle repeated for both channels of its pair (a valid rotation per
    token, not Wan's frequencies: enough for timing and for comparing two implementations)."""
    angles = torch.rand(1, tokens, 1, head_dim // 2, generator=generator) * 2 * math.pi
    angles = angles.repeat_interleave(2, dim=-1).to(device)
    return angles.cos(), angles.sin()


def wan_rotary_tables(
    grid: Sequence[int], head_dim: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' Wan RoPE tables for a latent token ``grid`` (frames, rows, columns; patch size 1): ``cos`` and
    ``sin`` ``(1, N, 1, D)`` float32, exactly what ``WanTransformer3DModel`` gives its processors (the fused kernels
    compute them from an angle plan: :mod:`mhla_diffusion.ops.rope_tables`)."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    cos, sin = WanRotaryPosEmbed(head_dim, (1, 1, 1), max_seq_len=1024)(torch.zeros(1, 1, *grid))
    return cos.to(device), sin.to(device)


def wan_self_attention(
    grid: Sequence[int],
    config: "MHLAConfig",
    *,
    heads: int = WAN_13B_HEADS,
    head_dim: int = WAN_13B_HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "meta",
    batch: int = 1,
    seed: int = 0,
) -> tuple["WanMHLAProcessor", Callable[[], torch.Tensor]]:
    """One Wan layer's MHLA self-attention, ready to call: a ``WanMHLAProcessor`` of ``config`` on
    ``device`` in ``dtype`` whose grid context holds ``grid``, and a zero-argument call of its path from
    projected ``q, k, v`` ``(B, N, H, D)`` to the attention output (feature map, RoPE, blocks, products,
    denominator, output norm and gate: :meth:`~mhla_diffusion.models.processors.base.MHLAProcessor.attend`).
    On ``meta`` the inputs are empty (for counting traffic); elsewhere random (seeded by ``seed``),
    with Wan's RoPE tables of the grid (:func:`wan_rotary_tables`)."""
    from ..models.processors.grid import TokenGridContext
    from ..models.processors.wan import WanMHLAProcessor

    grid = tuple(int(g) for g in grid)
    context = TokenGridContext()
    context.set_grid(grid)
    with torch.random.fork_rng(devices=[]):  # the gate's initialisation, seeded without touching the caller's RNG
        torch.manual_seed(seed)
        processor = WanMHLAProcessor(heads, head_dim, tuple(config.layout), config, context)
    processor = processor.to(device=device, dtype=dtype)
    layer_input, q, k, v, rotary = _attention_inputs(grid, heads, head_dim, dtype, device, batch, seed)
    return processor, lambda: processor.attend(layer_input, q, k, v, rotary)


def _attention_inputs(
    grid: tuple[int, ...],
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    batch: int,
    seed: int,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`wan_self_attention`'s inputs: the layer input ``(B, N, H*D)``, projected ``q, k, v``, the RoPE
    tables; empty on ``meta``, else random (seeded by ``seed``). ``requires_grad``: the first four are leaves
    that require grad (a training step's backward reaches them)."""
    n, inner = math.prod(grid), heads * head_dim
    if torch.device(device).type == "meta":
        layer_input = torch.empty(batch, n, inner, device="meta", dtype=dtype)
        q, k, v = (torch.empty(batch, n, heads, head_dim, device="meta", dtype=dtype) for _ in range(3))
        rotary = tuple(torch.empty(1, n, 1, head_dim, device="meta", dtype=torch.float32) for _ in range(2))
    else:
        g = torch.Generator().manual_seed(seed)
        layer_input = torch.randn(batch, n, inner, generator=g).to(device, dtype)
        q, k, v = (torch.randn(batch, n, heads, head_dim, generator=g).to(device, dtype) for _ in range(3))
        rotary = wan_rotary_tables(grid, head_dim, device)
    for t in (layer_input, q, k, v):
        t.requires_grad_(requires_grad)
    return layer_input, q, k, v, rotary


def count_path(call: Callable[[], Any], fused: bool = False) -> tuple[dict[str, tuple[int, int]], int]:
    """Bytes that ``call`` (on meta tensors) moves, ``{op or kernel term: (calls, bytes)}``, and how many
    fused launches it made. With ``fused``, MHLA processors inside take the fused Triton path
    (:func:`~mhla_diffusion.ops.triton_mhla.recording_launches`): its kernels are counted from their
    launch (:func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`), every other op as dispatched."""
    from ..ops.fused_causal import fused_causal_traffic
    from ..ops.traffic import count_traffic
    from ..ops.triton_mhla import fused_traffic, recording_launches

    with recording_launches() if fused else nullcontext([]) as launches:
        counter = count_traffic(call)
    items = {name: (calls, read + written) for name, (calls, read, written) in counter.by_op.items()}
    for launch in launches:  # a stream chunk's launch also mixes in its carried blocks
        _add_launch(items, fused_causal_traffic(**launch) if "carried" in launch else fused_traffic(**launch))
    return items, len(launches)


def _add_launch(items: dict[str, tuple[int, int]], terms: dict[str, int]) -> None:
    """Add one launch's ``{term: bytes}`` to ``items`` ``{op or kernel term: (calls, bytes)}``: one call each."""
    for term, size in terms.items():
        calls, before = items.get(term, (0, 0))
        items[term] = (calls + 1, before + size)


def wan_attention_traffic(
    grid: Sequence[int],
    config: "MHLAConfig",
    *,
    heads: int = WAN_13B_HEADS,
    head_dim: int = WAN_13B_HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    fused: bool = False,
) -> dict[str, Any]:
    """Bytes moved by one MHLA self-attention of a Wan layer (the processor's path from projected ``q, k,
    v`` to the attention output: feature map, RoPE, blocks, products, denominator, output norm and gate),
    counted on meta tensors (:mod:`mhla_diffusion.ops.traffic`). With ``fused``, the path the processor
    takes where the fused Triton kernels run: the kernels' bytes as their launch reads and writes them
    (:func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`), the rest (output norm, gate) op by op.
    Returns a row of :data:`TRAFFIC_COLUMNS` with the busiest ops (or kernel terms) under ``ops``."""
    from ..ops.traffic import floor_bytes

    grid = tuple(int(g) for g in grid)
    layout = tuple(config.layout)
    n = math.prod(grid)
    _, call = wan_self_attention(grid, config, heads=heads, head_dim=head_dim, dtype=dtype, batch=batch)
    items, launches = count_path(call, fused)
    floor = floor_bytes(batch, n, heads, head_dim, head_dim, num_blocks(layout), dtype)
    unit = batch * n * heads * head_dim * dtype.itemsize
    return _traffic_row(grid, layout, dtype, unit, floor, items, launches, fused)


def _traffic_row(
    grid: tuple[int, ...],
    layout: tuple[int, ...],
    dtype: torch.dtype,
    unit: int,
    floor: int,
    items: dict[str, tuple[int, int]],
    launches: int,
    fused: bool,
) -> dict[str, Any]:
    """A row of :data:`TRAFFIC_COLUMNS` from ``{op or kernel term: (calls, bytes)}``."""
    n, blocks = math.prod(grid), num_blocks(layout)
    total = sum(size for _, size in items.values())
    busiest = sorted(items.items(), key=lambda item: -item[1][1])[: 8 if not fused else None]
    return {
        "grid": _dims(grid),
        "tokens": n,
        "layout": _dims(layout),
        "blocks": blocks,
        "dtype": str(dtype).removeprefix("torch."),
        "gigabytes": total / 1e9,
        "units": total / unit,
        "floor_units": floor / unit,
        "over_floor": total / floor,
        "unit_bytes": unit,
        "fused_launches": launches,
        "ops": {name: {"calls": calls, "units": size / unit} for name, (calls, size) in busiest},
    }


#: The training rows of ``mhla bench --traffic``: one MHLA self-attention's forward and backward.
TRAINING_PATHS = ("eager PyTorch, forward + backward", "fused Triton, forward + backward (counted from the launches)")


def _count_with_backward(call: Callable[[], torch.Tensor]) -> dict[str, tuple[int, int]]:
    """``{op: (calls, bytes)}`` that ``call`` (on meta tensors) and autograd's backward from its output
    dispatch (the gradient of the output: an empty tensor, nothing moved for it)."""
    from ..ops.traffic import TrafficCounter

    with torch.enable_grad(), TrafficCounter() as counter:
        out = call()
        out.backward(torch.empty_like(out))
    return {name: (calls, read + written) for name, (calls, read, written) in counter.by_op.items()}


def wan_attention_training_traffic(
    grid: Sequence[int],
    config: "MHLAConfig",
    *,
    heads: int = WAN_13B_HEADS,
    head_dim: int = WAN_13B_HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    fused: bool = False,
) -> dict[str, Any]:
    """Bytes moved by one MHLA self-attention of a Wan layer in a training step: :func:`wan_attention_traffic`'s
    path forward, then its backward to the layer input, ``q, k, v`` and the processor's parameters (mixing,
    output norm, gate), counted on meta tensors (autograd runs there: nothing is computed).

    Eager: every op the forward and autograd's backward dispatch. With ``fused``, the path the processor takes
    where the fused Triton kernels run: the processor's other ops forward and backward (the eager count less
    the eager operator's own count, forward and backward, called alone with the processor's arguments: ops
    are counted one by one, so the difference is exact), plus the kernels from their launch, forward
    (:func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`) and backward
    (:func:`~mhla_diffusion.ops.triton_mhla_backward.fused_backward_traffic`, terms prefixed ``backward: ``).
    Its floor adds to the forward's the backward's least: ``q, k, v`` and the output's gradient read, ``dq, dk,
    dv`` written, the summaries' gradients written and read once."""
    from ..ops.traffic import floor_bytes
    from ..ops.triton_mhla import fused_traffic, recording_launches
    from ..ops.triton_mhla_backward import fused_backward_traffic

    grid = tuple(int(g) for g in grid)
    layout = tuple(config.layout)
    n = math.prod(grid)
    processor, _ = wan_self_attention(grid, config, heads=heads, head_dim=head_dim, dtype=dtype, batch=batch)
    layer_input, q, k, v, rotary = _attention_inputs(grid, heads, head_dim, dtype, "meta", batch, 0, True)
    items = _count_with_backward(lambda: processor.attend(layer_input, q, k, v, rotary))
    launches = 0
    if fused:
        for t in (layer_input, q, k, v, *processor.parameters()):
            t.grad = None  # a second backward would accumulate (add_) into them
        plan = processor.grid_context.plan(layout, q.device)
        features = dict(normalize=processor.normalization, eps=processor.eps, plan=plan, feature_eps=processor.eps)
        operator = _count_with_backward(
            lambda: mhla_attention(q, k, v, grid, layout, processor.mixing, rotary=rotary, **features)
        )
        for name, (calls, size) in operator.items():
            left = (items.get(name, (0, 0))[0] - calls, items.get(name, (0, 0))[1] - size)
            if min(left) < 0:
                raise RuntimeError(f"the eager operator's {name} is not among the processor's ops: count it anew")
            items[name] = left
        items = {name: item for name, item in items.items() if item != (0, 0)}
        with torch.no_grad(), recording_launches() as recorded:
            processor.attend(layer_input, q, k, v, rotary)
        for launch in recorded:
            backward = fused_backward_traffic(**{**launch, "rope_converted": False})  # the forward's, cached
            _add_launch(items, {**fused_traffic(**launch), **{f"backward: {t}": b for t, b in backward.items()}})
        launches = len(recorded)
    size = dtype.itemsize
    kept = 2 * batch * heads * num_blocks(layout) * (head_dim * head_dim + head_dim) * 4
    floor = floor_bytes(batch, n, heads, head_dim, head_dim, num_blocks(layout), dtype)
    floor += batch * n * heads * (4 * head_dim + 3 * head_dim) * size + kept
    return _traffic_row(grid, layout, dtype, batch * n * heads * head_dim * size, floor, items, launches, fused)


#: The grids ``mhla bench --traffic`` counts by default: Wan's 81 frames at 480x800 (3x5x10 blocks divide it)
#: and at its default 480x832 (they do not).
TRAFFIC_GRIDS = ((21, 30, 50), (21, 30, 52))


def traffic_table(
    grids: Sequence[Sequence[int]] = TRAFFIC_GRIDS, dtype: torch.dtype = torch.bfloat16
) -> list[dict[str, Any]]:
    """:func:`wan_attention_traffic` of the eager PyTorch path and of the fused Triton path for every grid
    and :func:`traffic_settings` entry (Wan2.1-1.3B shapes), then both again forward + backward
    (:func:`wan_attention_training_traffic`)."""
    rows = []
    for grid in grids:
        for setting, config in traffic_settings().items():
            for fused, path in ((False, TRAFFIC_PATHS[0]), (True, TRAFFIC_PATHS[1])):
                row = wan_attention_traffic(grid, config, dtype=dtype, fused=fused)
                rows.append({**row, "setting": setting, "path": path})
            for fused, path in ((False, TRAINING_PATHS[0]), (True, TRAINING_PATHS[1])):
                row = wan_attention_training_traffic(grid, config, dtype=dtype, fused=fused)
                rows.append({**row, "setting": setting, "path": path})
    return rows
