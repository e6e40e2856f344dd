"""Wan's RoPE as the fused Triton kernels take it: computed from each token's grid position when the tables are
separable (every angle ``phase_i + pos_a(i) * step_i``, ``pos_a`` one grid axis: Wan's and SkyReels-V2's are), else
read as tables (each angle once, the even channels ``(N, D/2)``, in the summaries' dtype).

Either form is made once per transformer forward (every layer gets the same two tables) and cached by identity and
write count (:class:`_RopeCache`); never fitted while a CUDA graph is captured (the fit reads the tables back to
check itself, a host sync).

Why compute: read as tables, the rotation is the largest term of the fused kernels after q, k, v and the outputs:
each of the four kernels (summaries, output, query and key gradients) reads ``(N, D/2)`` cos and sin per
(batch x head), 1 U each at Wan2.1-1.3B (``U = N x H x D x 2`` bytes), 4 U of a training step's 22 U
(:func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`). Computed, a program reads its ``(3, D/2)`` angle plan once
and spends a sine and a cosine per channel pair and token (the GPU's fast ``sin.approx``/``cos.approx`` after an
exact range reduction: absolute error below 1e-6, against 4e-3 for bf16 tables).
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from ..utils.tensor_versions import write_count

#: The largest deviation from the tables that the angle plan may make (float32 tables; half tables: twice their
#: epsilon): above it, the tables are read. Wan2.1's float32 tables deviate by at most 1e-6 at 21x30x52 tokens.
ANGLE_TOLERANCE = 2e-5


class Rotary(NamedTuple):
    """The rotation as one launch's kernels take it: ``first`` and ``second`` are the tables' cos and sin
    ``(N, D/2)`` (``angles`` false), or both the angle plan ``(3, D/2)`` float32 (``angles`` true: rows phase,
    step and axis, 0 frames, 1 rows, 2 columns); ``plane`` (rows x columns) and ``width`` (columns) turn a token
    index into its grid position (0 for tables)."""

    first: torch.Tensor
    second: torch.Tensor
    angles: bool
    plane: int
    width: int


def rotary_arguments(rope: Rotary | None, like: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """The kernels' rotary arguments: the two pointers; their four strides, plane and width; and the constexprs
    ``ROPE_ANGLES``, ``FAST_TRIG`` (the GPU's fast sine and cosine, not under the interpreter). Without RoPE
    (``None``): ``like`` as unused pointers, zeros."""
    if rope is None:
        return (like, like), (0,) * 6, dict(ROPE_ANGLES=False, FAST_TRIG=False)
    numbers = (*rope.first.stride(), *rope.second.stride(), rope.plane, rope.width)
    return (rope.first, rope.second), numbers, dict(ROPE_ANGLES=rope.angles, FAST_TRIG=like.device.type != "cpu")


def rotary_operand(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, grid: tuple[int, ...]) -> Rotary:
    """Diffusers' ``(1, N, 1, D)`` tables for a launch on ``grid`` (row-major tokens) whose summaries are in
    ``dtype``: :func:`_prepared_rotary` without the flag."""
    return _prepared_rotary(cos, sin, dtype, grid)[0]


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each angle of Diffusers' ``(1, N, 1, D)`` tables once: their even channels ``(N, D/2)`` in ``dtype``
    (views when already in it, else contiguous copies)."""
    tables = (cos[0, :, 0, 0::2], sin[0, :, 0, 0::2])
    return tables if all(t.dtype == dtype for t in tables) else _convert_tables(tables, dtype)


class _RopeCache:
    """The last rotary operand made, by identity: weak references to the ``cos``/``sin`` it was made from (the
    transformer passes the same two tensors to every layer of one forward), what identified their contents then
    (version counter, storage, shape, strides), the dtype and grid, and the operand."""

    def __init__(self) -> None:
        self.entry: tuple | None = None

    @staticmethod
    def _key(table: torch.Tensor) -> tuple | None:
        version = write_count(table)  # bumped by every in-place write to the tensor or a view of its storage
        if version is None:  # an inference tensor keeps no count: never reused
            return None
        return (
            version,
            table.data_ptr(),
            table.storage_offset(),
            tuple(table.shape),
            table.stride(),
            table.dtype,
            table.device,
        )

    def keys(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple | None:
        keys = (self._key(cos), self._key(sin))
        return None if None in keys else keys

    def get(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, grid: tuple) -> Rotary | None:
        if self.entry is None:
            return None
        cos_ref, sin_ref, keys, cached, operand = self.entry
        if cos_ref() is not cos or sin_ref() is not sin or cached != (dtype, grid):
            return None
        now = self.keys(cos, sin)
        return operand if now is not None and now == keys else None

    def put(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, grid: tuple, operand: Rotary) -> None:
        keys = self.keys(cos, sin)
        self.entry = None if keys is None else (weakref.ref(cos), weakref.ref(sin), keys, (dtype, grid), operand)


_ROPE_CACHE = _RopeCache()


def _prepared_rotary(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, grid: tuple[int, ...]
) -> tuple[Rotary, bool]:
    """The :class:`Rotary` of these tables and whether this call made it (``False``: the one an earlier call made of
    these very tensors, unchanged since: the same objects, version counters, storage, shape and strides).

    The angle plan when :func:`_angle_plan` reproduces every entry of the tables within :data:`ANGLE_TOLERANCE`;
    else the tables (:func:`_rope_tables`). Tables come back without a fit where a fit cannot be cached or must not
    sync: inference tensors (no version counter: every call would fit again), grids of more than three axes, and
    while a CUDA graph is captured (replays refill the graph's inputs without Python, so nothing made then is
    cached either). On ``meta`` tensors (counting traffic) the plan is assumed to fit."""
    grid3 = _grid3(grid)
    if _capturing(cos.device):  # a CUDA graph's replays write its inputs with no version change: no cache
        return _table_operand(cos, sin, dtype), True
    cached = _ROPE_CACHE.get(cos, sin, dtype, tuple(grid))
    if cached is not None:
        return cached, False
    if grid3 is None or _ROPE_CACHE.keys(cos, sin) is None:
        return _table_operand(cos, sin, dtype), True
    plan, deviation = _angle_plan(cos, sin, grid3)
    fits = cos.device.type == "meta" or deviation.item() <= _tolerance(cos.dtype, sin.dtype)
    if fits:
        operand = Rotary(plan, plan, True, grid3[1] * grid3[2], grid3[2])
    else:
        operand = _table_operand(cos, sin, dtype)
    _ROPE_CACHE.put(cos, sin, dtype, tuple(grid), operand)
    return operand, True


def _table_operand(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> Rotary:
    return Rotary(*_rope_tables(cos, sin, dtype), False, 0, 0)


def _tolerance(*dtypes: torch.dtype) -> float:
    return max(ANGLE_TOLERANCE, *(2 * torch.finfo(t).eps for t in dtypes))


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``grid`` as (frames, rows, columns), padded with ones in front; ``None`` beyond three axes."""
    if not grid or len(grid) > 3:
        return None
    return (1,) * (3 - len(grid)) + tuple(int(n) for n in grid)


def _wrapped(angle: torch.Tensor) -> torch.Tensor:
    """``angle`` in ``[-pi, pi)``."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def _angle_plan(cos: torch.Tensor, sin: torch.Tensor, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The angle plan ``(3, D/2)`` float32 of Diffusers' ``(1, N, 1, D)`` tables on a row-major ``grid`` of
    (frames, rows, columns), and how far the tables' even channels are from it (a 0-dim float64 tensor; ``inf``
    where no plan of this form gives them).

    Row 0 is each pair's angle at the first token (its phase), row 1 the angle it turns per step along its axis,
    row 2 that axis (the one it turns most along; 0 where it turns along none): read off the first token and its
    three neighbours, in float64. Then the check, which reads each table once: the pairs of one axis must form a
    range of channels (Wan's frames, rows, columns do) whose values repeat exactly along the two other axes (as
    tables built by broadcasting do), and the line along their own axis must match ``phase + pos * step`` of the
    float32 plan as the kernels use it; the largest difference there is the deviation returned. On ``meta``
    tensors the check's ops run as if every pair turned along the frames (for counting its traffic)."""
    c4 = cos[0, :, 0, 0::2].unflatten(0, grid)  # (F, H, W, P) views: nothing copied
    s4 = sin[0, :, 0, 0::2].unflatten(0, grid)
    pairs = c4.shape[-1]
    corners = [(0, 0, 0), (min(1, grid[0] - 1), 0, 0), (0, min(1, grid[1] - 1), 0), (0, 0, min(1, grid[2] - 1))]
    angle = torch.atan2(torch.stack([s4[i] for i in corners]).double(), torch.stack([c4[i] for i in corners]).double())
    steps = _wrapped(angle[1:] - angle[0])  # (3, P): per step along frames, rows, columns
    axis = steps.abs().argmax(0)
    plan = torch.stack([angle[0], steps.gather(0, axis[None])[0], axis.double()]).to(torch.float32)
    ranges = [(0, 0, pairs)] if cos.device.type == "meta" else _axis_ranges(axis.tolist())
    deviation = torch.zeros((), dtype=torch.float64, device=cos.device)
    if ranges is None:
        return plan, deviation + math.inf
    constant = torch.ones((), dtype=torch.bool, device=cos.device)
    for a, lo, hi in ranges:
        line = tuple(slice(None) if d == a else slice(0, 1) for d in range(3))
        shape = [grid[a] if d == a else 1 for d in range(3)] + [1]
        position = torch.arange(grid[a], device=cos.device, dtype=torch.float64).view(shape)
        rebuilt = plan[0, lo:hi].double() + position * plan[1, lo:hi].double()
        for table, turn in ((c4, torch.cos), (s4, torch.sin)):
            part = table[..., lo:hi]
            constant &= (part == part[line]).all()  # the values repeat along the other two axes
            deviation = torch.maximum(deviation, (turn(rebuilt) - part[line].double()).abs().amax())
    return plan, torch.where(constant, deviation, math.inf)


def _axis_ranges(axis: list[int]) -> list[tuple[int, int, int]] | None:
    """``(axis, first pair, end)`` of each run of pairs that turn along one axis, or ``None`` when an axis has
    more than one run."""
    ranges: list[tuple[int, int, int]] = []
    for i, a in enumerate(axis):
        if ranges and ranges[-1][0] == a:
            ranges[-1] = (a, ranges[-1][1], i + 1)
        elif any(r[0] == a for r in ranges):
            return None
        else:
            ranges.append((a, i, i + 1))
    return ranges


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _convert_tables(tables: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous copies of the even-channel tables ``(N, D/2)`` in ``dtype`` (one ``(2, N, D/2)`` tensor)."""
    out = torch.empty((2, *tables[0].shape), dtype=dtype, device=tables[0].device)
    out[0].copy_(tables[0])
    out[1].copy_(tables[1])
    return out[0], out[1]
