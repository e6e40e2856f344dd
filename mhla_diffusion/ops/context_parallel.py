"""Context-parallel MHLA: one token sequence split across processes, exact, with fixed traffic.

A block's key-value summary ``S_j = Σ_{s in block j} k̂_s v_sᵀ`` and key sum ``z_j = Σ k_s`` are sums
over its tokens, so a process that holds a contiguous range of the row-major token sequence (a
:class:`TokenShard`) sums its own tokens into *partial* summaries -- blocks that straddle two
processes included -- and one all-reduce of the ``(B, H, M, D*Dv [+ D])`` partials gives every
process every block's full summary. Each process then mixes the rows of the blocks its queries sit
in and answers its own queries:

    out_t = q̂_t · S̃_b(t) / (max(q_t · z̃_b(t), 0) + eps),   S̃_o = Σ_j W[o, j] S_j    (as :func:`mhla_attention`)

The result equals the one-process operator (up to float summation order), and the traffic per layer
is ``B x H x M x D x Dv`` (+ ``B x H x M x D`` with a denominator) numbers whatever the sequence
length. The released DiT denominator (``"scalar_mixed_denominator"``) needs, for the token at
within-block position ``w``, the scalars ``q_(j,w) · z_j`` of the same position in *every* block: a
second all-reduce of ``B x H x N`` scalars, the one part whose traffic grows with ``N``.

The backward of the all-reduce is an all-reduce of the summaries' gradients (each process's summary
feeds every process's queries), so gradients with respect to a process's own q, k, v are those of
the one-process run; parameter gradients are partial sums over each process's tokens and add up
(over the context-parallel group) to the one-process gradients.

:func:`gather_token_window` fetches the tokens of a range held by other processes (point-to-point,
with the matching backward), which the LePE convolution needs at the range's edges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..utils.geometry import check_equal_blocks
from ..utils.sequence_split import split_sizes
from .attention import (
    _mhla_blocks,
    check_feature_arguments,
    normalization_mode,
    validate_attention_inputs,
    without_autocast,
)
from .block_layout import BlockPlan, block_plan

__all__ = [
    "LocalBlockPlan",
    "TokenShard",
    "all_reduce_sum",
    "gather_token_window",
    "grid_conv_context_parallel",
    "local_block_plan",
    "mhla_attention_context_parallel",
    "split_sizes",
]


@dataclass(frozen=True)
class TokenShard:
    """One process's contiguous range of a row-major token sequence of ``sum(sizes)`` tokens.

    ``sizes[r]`` tokens are held by rank ``r`` of ``group`` (``None``: the default process group),
    in rank order; this process is ``rank`` and holds tokens ``start .. stop - 1``.
    """

    group: Any
    rank: int
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        """Tokens of the whole sequence."""
        return sum(self.sizes)

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.sizes[self.rank]

    @property
    def num_local(self) -> int:
        return self.sizes[self.rank]

    def range_of(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the tokens held by ``rank``."""
        start = sum(self.sizes[:rank])
        return start, start + self.sizes[rank]

    @classmethod
    def split(cls, total: int, group: Any = None, *, even: bool) -> "TokenShard":
        """This process's shard of ``total`` tokens over ``group`` under :func:`split_sizes`' rule."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "context-parallel MHLA needs torch.distributed: call torch.distributed.init_process_group(...) first "
                "(launch with torchrun --nproc_per_node P)"
            )
        world = dist.get_world_size(group)
        return cls(group, dist.get_rank(group), split_sizes(total, world, even))

    @classmethod
    def from_parallel_config(cls, parallel_config: Any, total: int) -> "TokenShard | None":
        """This process's shard under Diffusers' context parallelism, or ``None`` without it.

        ``parallel_config`` is what ``enable_parallelism`` sets on attention processors (a Diffusers
        ``ParallelConfig``). Diffusers splits the sequence over the flattened ``(ring, ulysses)`` mesh
        in mesh-rank order: ``torch.chunk`` (even split; it refuses ``N % P != 0``) by default,
        ``torch.tensor_split`` with ``ulysses_anything`` / ``ring_anything``; both are
        :func:`split_sizes`.
        """
        cp = getattr(parallel_config, "context_parallel_config", None)
        if cp is None:
            return None
        mesh = getattr(cp, "_flattened_mesh", None)
        if mesh is None:
            raise RuntimeError(
                "the context-parallel config has no device mesh yet: enable it on the model with "
                "mhla_diffusion.enable_context_parallel(transformer, ...) or transformer.enable_parallelism(config=...)"
            )
        group = mesh.get_group()
        even = not (cp.ulysses_anything or cp.ring_anything)
        return cls(group, dist.get_rank(group), split_sizes(total, dist.get_world_size(group), even))


@dataclass(frozen=True)
class LocalBlockPlan:
    """How one process's tokens regroup into padded blocks (the local counterpart of :class:`BlockPlan`).

    ``blocks`` ``(M_l,)``: the (global) blocks holding at least one local token, ascending;
    ``gather[m * P_l + p]``: the local token at slot ``p`` of local block ``m`` (padding repeats one of
    that block's tokens and is ``False`` in ``valid``, which is ``None`` when no slot is padding);
    ``scatter[i]``: the slot of local token ``i``; ``block_of[i]``: its local block index;
    ``position[i]``: its global within-block slot (the ``w`` of ``(o, w)``).
    """

    blocks: torch.Tensor
    block_len: int
    gather: torch.Tensor
    scatter: torch.Tensor
    valid: torch.Tensor | None
    block_of: torch.Tensor
    position: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.numel())


def local_block_plan(plan: BlockPlan, start: int, stop: int) -> LocalBlockPlan:
    """The :class:`LocalBlockPlan` of tokens ``start .. stop - 1`` of ``plan``'s grid (O(N_local) integer work).

    Block membership comes from ``plan.scatter`` (``block * P + slot`` of every token), so the
    token -> block rule stays in :mod:`mhla_diffusion.ops.block_layout`. Local blocks are padded only to
    the largest number of *local* tokens in one block, so the work buffers scale with the local
    token count even when every block straddles processes.
    """
    n = plan.scatter.numel()
    if not 0 <= start < stop <= n:
        raise ValueError(f"token range [{start}, {stop}) is not a non-empty part of the grid's {n} tokens")
    slots = plan.scatter[start:stop]
    block = torch.div(slots, plan.block_len, rounding_mode="floor")
    order = torch.argsort(block, stable=True)  # local tokens grouped by block, row-major inside each
    blocks, counts = torch.unique_consecutive(block[order], return_counts=True)
    m, p = blocks.numel(), int(counts.max())
    first = torch.cumsum(counts, 0) - counts  # first sorted index of each local block
    block_index = torch.repeat_interleave(torch.arange(m, device=slots.device), counts)
    offset = torch.arange(order.numel(), device=slots.device) - first[block_index]
    scatter = torch.empty_like(order)
    scatter[order] = block_index * p + offset
    block_of = torch.empty_like(order)
    block_of[order] = block_index
    pad = torch.arange(p, device=slots.device)
    taken = first[:, None] + torch.minimum(pad[None, :], counts[:, None] - 1)  # (M_l, P_l), clamped into the block
    valid = pad[None, :] < counts[:, None]
    return LocalBlockPlan(
        blocks=blocks,
        block_len=p,
        gather=order[taken.reshape(-1)],
        scatter=scatter,
        valid=None if bool(valid.all()) else valid,
        block_of=block_of,
        position=slots - block * plan.block_len,
    )


class _AllReduceSum(torch.autograd.Function):
    """``Σ_r x_r`` over a process group; its backward all-reduces the gradients the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: Any = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (every process gets it), differentiable; communicated in ``dtype``
    (default ``x``'s) and returned in ``x``'s dtype.

    The backward is an all-reduce of the output's gradients: each process's ``x`` feeds every
    process's result, so its gradient is the sum of what all of them send back.
    """
    wire = x if dtype is None or dtype == x.dtype else x.to(dtype)
    return _AllReduceSum.apply(wire, group).to(x.dtype)


def _window_transfers(shard: TokenShard, windows: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """``(sender, receiver, start, stop)`` for every part of a rank's window held by another rank."""
    transfers = []
    for receiver, (lo, hi) in enumerate(windows):
        for sender in range(shard.world_size):
            own_lo, own_hi = shard.range_of(sender)
            start, stop = max(lo, own_lo), min(hi, own_hi)
            if sender != receiver and start < stop:
                transfers.append((sender, receiver, start, stop))
    return transfers


def _exchange(
    shard: TokenShard,
    transfers: list[tuple[int, int, int, int]],
    send: dict[int, torch.Tensor],
    receive: dict[int, torch.Tensor],
) -> None:
    """Post the sends and receives of ``transfers`` (keyed by transfer index) and wait for them."""
    global_rank = (lambda r: r) if shard.group is None else (lambda r: dist.get_global_rank(shard.group, r))
    requests = []
    for index, (sender, receiver, _, _) in enumerate(transfers):
        if sender == shard.rank:
            requests.append(dist.isend(send[index].contiguous(), global_rank(receiver), group=shard.group))
        elif receiver == shard.rank:
            requests.append(dist.irecv(receive[index], global_rank(sender), group=shard.group))
    for request in requests:
        request.wait()


class _GatherWindow(torch.autograd.Function):
    """Tokens ``lo .. hi - 1`` of the whole sequence from the processes that hold them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: TokenShard, windows: tuple[tuple[int, int], ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.shard, ctx.windows = shard, windows
        lo, hi = windows[shard.rank]
        start = shard.start
        transfers = _window_transfers(shard, windows)
        out = x.new_empty((x.shape[0], hi - lo, *x.shape[2:]))
        own_lo, own_hi = max(lo, start), min(hi, shard.stop)
        if own_lo < own_hi:
            out[:, own_lo - lo : own_hi - lo] = x[:, own_lo - start : own_hi - start]
        send = {i: x[:, a - start : b - start] for i, (s, _, a, b) in enumerate(transfers) if s == shard.rank}
        receive = {i: out[:, a - lo : b - lo] for i, (_, r, a, b) in enumerate(transfers) if r == shard.rank}
        buffers = {i: torch.empty_like(t) for i, t in receive.items()}  # receive into contiguous buffers
        _exchange(shard, transfers, send, buffers)
        for i, t in receive.items():
            t.copy_(buffers[i])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        shard, windows = ctx.shard, ctx.windows
        lo, hi = windows[shard.rank]
        start = shard.start
        transfers = _window_transfers(shard, windows)
        result = grad.new_zeros((grad.shape[0], shard.num_local, *grad.shape[2:]))
        own_lo, own_hi = max(lo, start), min(hi, shard.stop)
        if own_lo < own_hi:
            result[:, own_lo - start : own_hi - start] += grad[:, own_lo - lo : own_hi - lo]
        # the gradient of a token sent to another rank comes back from that rank: reversed transfers
        send = {i: grad[:, a - lo : b - lo] for i, (_, r, a, b) in enumerate(transfers) if r == shard.rank}
        buffers = {
            i: grad.new_empty((grad.shape[0], b - a, *grad.shape[2:]))
            for i, (s, _, a, b) in enumerate(transfers)
            if s == shard.rank
        }
        reversed_transfers = [(r, s, a, b) for s, r, a, b in transfers]
        _exchange(shard, reversed_transfers, send, buffers)
        for i, t in buffers.items():
            _, _, a, b = transfers[i]
            result[:, a - start : b - start] += t
        return result, None, None


def gather_token_window(x: torch.Tensor, shard: TokenShard, windows: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Tokens ``windows[shard.rank]`` of the whole sequence, fetched from the processes that hold them.

    Args:
        x: this process's tokens ``(B, N_local, ...)`` (``N_local = shard.num_local``).
        shard: the split of the sequence.
        windows: ``(lo, hi)`` for *every* rank (all processes must pass the same list): the part of the
            sequence each one needs. Only the parts held by another process travel (point-to-point).

    Returns ``(B, hi - lo, ...)``; differentiable (a token's gradient goes back to its holder).
    """
    windows = tuple((int(lo), int(hi)) for lo, hi in windows)
    if len(windows) != shard.world_size or any(not 0 <= lo < hi <= shard.total for lo, hi in windows):
        raise ValueError(f"`windows` must give one non-empty range inside [0, {shard.total}) per rank, got {windows}")
    if x.shape[1] != shard.num_local:
        raise ValueError(f"`x` holds {x.shape[1]} tokens but rank {shard.rank}'s shard has {shard.num_local}")
    return _GatherWindow.apply(x, shard, windows)


def grid_conv_context_parallel(
    conv: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grid: Sequence[int], shard: TokenShard
) -> torch.Tensor:
    """A 3-tap-per-axis convolution over the token grid (LePE) of one process's tokens, exactly as on
    the whole grid.

    The token ``t`` reads its neighbours up to ``halo = Σ_a stride_a`` positions away in the row-major
    sequence (``stride_a``: tokens per step along axis ``a``; Wan: ``H*W + W + 1``), so each process
    fetches the ``halo`` tokens on either side of its range from their holders
    (:func:`gather_token_window`: point-to-point, traffic ``2 x halo x C`` values per process, fixed
    by the frame size, not the frame count), lays them into whole leading-axis slices with zeros
    elsewhere, runs ``conv`` (``padding=1``, zero padding at the grid's own borders) and keeps its
    own tokens. Zeros placed outside the fetched window only reach outputs that are dropped.

    Args:
        conv: ``(B, C, *slab)`` -> ``(B, C, *slab)``, e.g. a depthwise ``Conv3d(C, C, 3, padding=1)``;
            ``slab`` is ``grid`` with fewer leading-axis slices.
        x: this process's tokens ``(B, N_local, C)``.
        grid: the whole token grid (row-major, product ``shard.total``).

    Returns ``(B, N_local, C)``.
    """
    grid = tuple(int(g) for g in grid)
    strides = [math.prod(grid[a + 1 :]) for a in range(len(grid))]
    halo, row = sum(strides), strides[0]
    windows = [
        (max(0, lo - halo), min(shard.total, hi + halo))
        for lo, hi in (shard.range_of(r) for r in range(shard.world_size))
    ]
    lo, hi = windows[shard.rank]
    window = gather_token_window(x, shard, windows)  # (B, hi - lo, C)
    first, last = lo // row, -(-hi // row)  # whole leading-axis slices covering the window
    slab = torch.nn.functional.pad(window, (0, 0, lo - first * row, last * row - hi))  # (B, slices*row, C)
    batch, channels = x.shape[0], x.shape[-1]
    image = slab.transpose(1, 2).reshape(batch, channels, last - first, *grid[1:])
    out = conv(image).reshape(batch, channels, -1).transpose(1, 2)
    return out[:, shard.start - first * row : shard.stop - first * row]


@dataclass
class _SplitSequence:
    """The block math's context-parallel hook (:class:`~mhla_diffusion.ops.attention.SequenceSplit`): partial sums
    of this process's keys placed at their global blocks and all-reduced over ``shard.group``."""

    shard: TokenShard
    whole: BlockPlan
    plan: LocalBlockPlan
    reduce_dtype: torch.dtype | None

    @property
    def blocks(self) -> torch.Tensor:
        return self.plan.blocks

    @property
    def slot_positions(self) -> torch.Tensor:
        return self.plan.position[self.plan.gather].view(self.plan.num_blocks, self.plan.block_len)

    def complete(
        self, kv_summary: torch.Tensor, key_sum: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, heads, _, d, dv = kv_summary.shape
        compute = torch.promote_types(kv_summary.dtype, torch.float32)
        partial = kv_summary.flatten(-2).to(compute)  # (B, H, M_l, D*Dv)
        if key_sum is not None:
            partial = torch.cat((partial, key_sum.to(compute)), dim=-1)  # with z_j: one all-reduce for both
        placed = partial.new_zeros((batch, heads, self.whole.num_blocks, partial.shape[-1]))
        every = all_reduce_sum(placed.index_copy(2, self.plan.blocks, partial), self.shard.group, self.reduce_dtype)
        full = every[..., : d * dv].unflatten(-1, (d, dv)).to(kv_summary.dtype)
        return full, (None if key_sum is None else every[..., d * dv :].to(key_sum.dtype))

    def complete_scalars(self, scalars: torch.Tensor) -> torch.Tensor:
        batch, heads = scalars.shape[:2]
        plan, p = self.plan, self.whole.block_len
        slots = (plan.blocks[:, None] * p + self.slot_positions).reshape(-1)  # global slot of each local slot
        values = scalars.reshape(batch, heads, -1)
        if plan.valid is not None:  # padded local slots repeat a token: leave them out of the sum
            keep = plan.valid.reshape(-1).nonzero().squeeze(-1)
            slots, values = slots[keep], values.index_select(2, keep)
        every = values.new_zeros((batch, heads, self.whole.num_blocks * p)).index_copy(2, slots, values)
        return all_reduce_sum(every, self.shard.group, self.reduce_dtype).view(batch, heads, -1, p)


def mhla_attention_context_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: Sequence[int],
    layout: Sequence[int],
    mixing: torch.Tensor,
    shard: TokenShard,
    *,
    q_rot: torch.Tensor | None = None,
    k_rot: torch.Tensor | None = None,
    normalize: bool | str = True,
    eps: float = 1e-6,
    plan: BlockPlan | None = None,
    local_plan: LocalBlockPlan | None = None,
    reduce_dtype: torch.dtype | None = None,
    feature_eps: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`~mhla_diffusion.ops.attention.mhla_attention` of one process's tokens of a split sequence.

    Every process of ``shard.group`` calls it (collectively) with its own tokens. The block math is the
    one-process operator's, with a hook that all-reduces the keys' partial summaries.

    Args:
        q, k: this process's feature-mapped queries and keys ``(B, N_local, H, D)`` (with ``feature_eps``,
            its raw projections): tokens ``shard.start .. shard.stop - 1`` of the row-major ``grid``.
        v: its values ``(B, N_local, H, Dv)``.
        grid, layout, mixing, q_rot, k_rot, normalize, eps, feature_eps, rotary: as :func:`mhla_attention`;
            ``grid`` is the *whole* sequence's grid (product ``shard.total``), ``q_rot`` / ``k_rot`` and the
            ``rotary`` tables local.
        shard: the split (group, this rank, tokens per rank).
        plan: the whole grid's :class:`BlockPlan` (default: built here).
        local_plan: :func:`local_block_plan` of ``plan`` for this shard (default: built here).
        reduce_dtype: dtype of the all-reduced summaries (default: at least float32; ``torch.bfloat16``
            halves the traffic and rounds the partial sums).

    Returns:
        ``(B, N_local, H, Dv)`` in ``v``'s dtype: the one-process result for this process's tokens.
    """
    if q.shape[1] != shard.num_local:
        raise ValueError(
            f"`q` holds {q.shape[1]} tokens but rank {shard.rank}'s shard of the {shard.total}-token sequence has "
            f"{shard.num_local}: pass each process's own tokens"
        )
    grid, layout = validate_attention_inputs(q, k, v, grid, layout, mixing, q_rot, k_rot, plan, num_tokens=shard.total)
    check_feature_arguments(q, q_rot, k_rot, feature_eps, rotary)
    normalize = normalization_mode(normalize)
    if plan is None:
        plan = block_plan(grid, layout, device=q.device)
    if normalize == "scalar_mixed_denominator" and plan.valid is not None:
        check_equal_blocks(grid, layout)
    if local_plan is None:
        local_plan = local_block_plan(plan, shard.start, shard.stop)
    split = _SplitSequence(shard, plan, local_plan, reduce_dtype)
    with without_autocast(q.device):
        return _mhla_blocks(
            q,
            k,
            v,
            plan,
            mixing,
            q_rot,
            k_rot,
            normalize=normalize,
            eps=eps,
            feature_eps=feature_eps,
            rotary=rotary,
            split=split,
        )
