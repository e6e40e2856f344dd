"""The eager operator's folded CPU path (:func:`_folded_blocks`): the paper's MHLA without rotation, the key sums
folded into the summaries, blocks regrouped a cache-sized chunk at a time and the chunks run on worker threads.

:func:`~mhla_diffusion.ops.attention.mhla_attention` takes it on a CPU when it applies (float32/64, the paper's
denominator, no rotation, see ``_mhla_blocks``); everything else runs through the general block path there.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Iterator, Sequence

import torch

from .cpu_workers import run_chunks

#: On a CPU, the folded path regroups about this many bytes of keys (or queries) at a time: a share of the
#: last-level cache, so that each block copy is read back by its product from cache rather than from memory.
CPU_CHUNK_BYTES = 4 << 20

#: ... but a block larger than that is cut into parts of at least this many tokens: the products over a
#: part are as long as the part, and short ones run far below the machine's rate.
CPU_MIN_PART_TOKENS = 256


def _folded_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: Any,  # attention._Blocks (not imported here: attention imports this module)
    mixing: torch.Tensor,
    eps: float,
    feature_eps: float | None,
) -> torch.Tensor:
    """The paper's operator without rotation, with the key sums folded into the summaries.

    Every block's key sum rides in its summary as one more value channel (a column of ones):
    ``S'_j = φ(K_j)ᵀ [V_j | 1] = [S_j | z_j]``; one product mixes both, and ``q · z̃`` comes out of the query
    product as its last channel, so no pass over keys or queries is spent on the denominator.

    Blocks are regrouped a chunk at a time (:class:`_EvenChunks` or :class:`_GatheredChunks`) into reused
    buffers of ``C`` blocks of up to ``T`` tokens, every token's heads kept together, so a regroup copies
    whole token rows and each head's block is still a plain strided matrix (row stride ``H * d``) for the
    products. With several torch threads the chunks run on worker threads, each with its own buffers and
    one chunk at a time from copy to products (:func:`~mhla_diffusion.ops.cpu_workers.run_chunks`: a chunk's
    data stays in one core's caches, and no op waits for another thread). ``feature_eps``: apply
    ``φ(x) = ReLU(x) + feature_eps`` to ``q`` and ``k`` in the regrouping pass. Returns ``(B, N, H, Dv)`` in
    ``v``'s dtype.
    """
    batch, _, heads, d = q.shape
    dv = v.shape[-1]
    dtype, device = blocks.dtype, q.device
    chunks = (_EvenChunks if blocks.even else _GatheredChunks)(blocks, batch, heads * d * dtype.itemsize, device)
    c, t = chunks.blocks, chunks.tokens
    groups = chunks.groups()
    summaries = _padded_rows((batch, blocks.plan.num_blocks), (heads, d, dv + 1), dtype, device)  # [S_j | z_j]

    def key_buffers() -> tuple[torch.Tensor, torch.Tensor]:  # one pair per thread that runs chunks
        values = _padded_rows((c, t), (heads, dv + 1), dtype, device)
        values[..., -1] = 1
        return _padded_rows((c, t), (heads, d), dtype, device), values

    run_chunks(functools.partial(_summarise_chunk, chunks, k, v, summaries, feature_eps), groups, key_buffers, device)
    mixed = _mix_heads_last(mixing.to(dtype), summaries.flatten(-2)).unflatten(-1, (d, dv + 1))  # [S̃_o | z̃_o]
    del summaries
    result = torch.empty(v.shape, dtype=v.dtype, device=device)

    def query_buffers() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty((c, heads, t, dv + 1), dtype=dtype, device=device)
        return _padded_rows((c, t), (heads, d), dtype, device), out

    def output(chunk: tuple[int, ...], buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
        query_buffer, out = buffers
        queries = chunks.read(q, chunk, query_buffer, feature_eps)
        chunks.output(chunk, queries, mixed, out, result, eps)

    run_chunks(output, groups, query_buffers, device)
    return result


def _summarise_chunk(
    chunks: "_EvenChunks | _GatheredChunks",
    k: torch.Tensor,
    v: torch.Tensor,
    summaries: torch.Tensor,
    feature_eps: float | None,
    chunk: tuple[int, ...],
    buffers: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """The folded path's first pass over one ``chunk``: its keys and values regrouped into the calling thread's
    ``buffers`` (keys, values with a ones column), their ``[S_j | z_j]`` into ``summaries``."""
    key_buffer, values = buffers
    keys = chunks.read(k, chunk, key_buffer, feature_eps)
    chunks.read(v, chunk, values[..., :-1])
    chunks.summarise(chunk, keys, values, summaries)


class _EvenChunks:
    """The folded path's chunks on a grid that the layout divides: index tuples into the strided view
    :meth:`_Blocks.heads_last_view` ``(B, L.., P.., H, d)`` of token order, fixing its first ``level`` dims.

    While ``level <= 1 + axes`` a chunk holds whole blocks; deeper, it is the part of one block, whose summary
    is then accumulated over the parts. A chunk is everything on accelerators, about :data:`CPU_CHUNK_BYTES`
    on a CPU (parts of at least :data:`CPU_MIN_PART_TOKENS` tokens where the grid allows).
    """

    def __init__(self, blocks: Any, batch: int, row_bytes: int, device: torch.device) -> None:
        self.view, self.layout, self.axes = blocks.heads_last_view, blocks.plan.layout, len(blocks.plan.layout)
        lead = [batch, *self.layout, *blocks.pads]
        limit = CPU_CHUNK_BYTES if device.type == "cpu" else None
        level = 0
        while limit is not None and level < len(lead) and math.prod(lead[level:]) * row_bytes > limit:
            if level >= 1 + self.axes and math.prod(lead[level + 1 :]) < CPU_MIN_PART_TOKENS:
                break  # a part of one block, and a finer cut would make it too short
            level += 1
        self.level = level
        self.blocks = math.prod(lead[min(level, 1 + self.axes) : 1 + self.axes])
        self.tokens = math.prod(lead[max(level, 1 + self.axes) :])
        self._chunks = list(itertools.product(*(range(n) for n in lead[:level])))

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._chunks)

    def groups(self) -> list[list[tuple[int, ...]]]:
        """The chunks in runs that one thread must take in order: the parts of one block (a later part adds
        into the summary of the earlier ones), else every chunk alone."""
        block = lambda chunk: chunk[: 1 + self.axes]  # noqa: E731
        return [list(parts) for _, parts in itertools.groupby(self._chunks, key=block)]

    def read(
        self, x: torch.Tensor, chunk: tuple[int, ...], into: torch.Tensor, feature_eps: float | None = None
    ) -> torch.Tensor:
        """The chunk's tokens of ``x`` ``(B, N, H, d)`` copied into ``into`` ``(C, T, H, d)`` (returned),
        feature-mapped with ``feature_eps``."""
        source = self.view(x)[chunk]
        target = into.view(source.shape)  # splits C and T into the view's dims
        if feature_eps is None:
            target.copy_(source)
        else:
            torch.clamp_min(source, 0, out=target).add_(feature_eps)
        return into

    def _blocks_of(self, x: torch.Tensor, chunk: tuple[int, ...]) -> torch.Tensor:
        """The chunk's blocks of ``x`` ``(B, M, H, ...)`` as ``(C, H, ...)``."""
        return x.unflatten(1, self.layout)[chunk[: 1 + self.axes]].view(self.blocks, *x.shape[2:])

    def summarise(
        self, chunk: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor, summaries: torch.Tensor
    ) -> None:
        """``[S_j | z_j]`` of the chunk's blocks into ``summaries`` ``(B, M, H, d, Dv + 1)``, added to the earlier
        parts' where the chunk is a later part of its block."""
        out = self._blocks_of(summaries, chunk)
        later_part = any(chunk[1 + self.axes :])
        _blocks_by_heads_bmm(keys.permute(0, 2, 3, 1), values.permute(0, 2, 1, 3), out, accumulate=later_part)

    def output(
        self,
        chunk: tuple[int, ...],
        queries: torch.Tensor,
        mixed: torch.Tensor,
        out: torch.Tensor,
        result: torch.Tensor,
        eps: float,
    ) -> None:
        """The chunk's queries against their blocks' ``[S̃_o | z̃_o]`` (in ``out`` ``(C, H, T, Dv + 1)``), the
        numerator divided by ``max(q · z̃, 0) + eps`` straight into token order in ``result`` ``(B, N, H, Dv)``."""
        _blocks_by_heads_bmm(queries.permute(0, 2, 1, 3), self._blocks_of(mixed, chunk), out)
        target = self.view(result)
        numerator = out.permute(0, 2, 1, 3).view(*target.shape[self.level : -1], out.shape[-1])
        torch.div(numerator[..., :-1], numerator[..., -1:].clamp_min_(0).add_(eps), out=target[chunk])


class _GatheredChunks:
    """The folded path's chunks on a grid that the layout does not divide (CPU only): runs of whole blocks,
    about :data:`CPU_CHUNK_BYTES` of slots each, whose tokens are read by index and packed one block after
    the other, each block as long as its own tokens (no padded slot is read, multiplied or stored). A chunk's
    buffers are ``(1, R, ...)``: its ``R`` packed token rows.
    """

    def __init__(self, blocks: Any, batch: int, row_bytes: int, device: torch.device) -> None:
        plan = blocks.plan
        p = plan.block_len
        per_run = max(1, min(plan.num_blocks, CPU_CHUNK_BYTES // (p * row_bytes)))
        self._runs = []  # (first block, [(first row, rows) per block], the tokens of those rows)
        for first in range(0, plan.num_blocks, per_run):
            valid = plan.valid[first : first + per_run]  # (C, P)
            lengths = valid.sum(1).tolist()
            starts = [0, *itertools.accumulate(lengths)][:-1]
            kept = valid.reshape(-1).nonzero().squeeze(1)  # block-major, so the tokens come packed
            self._runs.append((first, list(zip(starts, lengths)), plan.gather[first * p + kept]))
        self.blocks, self.tokens = 1, max(len(tokens) for _, _, tokens in self._runs)
        self._chunks = [(b, run) for b in range(batch) for run in range(len(self._runs))]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._chunks)

    def groups(self) -> list[list[tuple[int, int]]]:
        """Every chunk alone: a chunk holds whole blocks, so any thread may take any chunk."""
        return [[chunk] for chunk in self._chunks]

    def read(
        self, x: torch.Tensor, chunk: tuple[int, int], into: torch.Tensor, feature_eps: float | None = None
    ) -> torch.Tensor:
        """The chunk's tokens of ``x`` ``(B, N, H, d)`` packed into the first rows of ``into`` ``(1, R, H, d)``,
        feature-mapped with ``feature_eps``; returns those rows ``(R_chunk, H, d)``."""
        b, run = chunk
        tokens = self._runs[run][2]
        rows = into[0, : len(tokens)]
        if x.dtype == rows.dtype:
            torch.index_select(x[b], 0, tokens, out=rows)
        else:  # computed in a wider dtype than this input's
            rows.copy_(x[b].index_select(0, tokens))
        if feature_eps is not None:
            rows.clamp_min_(0).add_(feature_eps)
        return rows

    def summarise(
        self, chunk: tuple[int, int], keys: torch.Tensor, values: torch.Tensor, summaries: torch.Tensor
    ) -> None:
        """``[S_j | z_j]`` of the chunk's blocks into ``summaries`` ``(B, M, H, d, Dv + 1)`` (zero for an empty
        block); ``keys`` are the packed rows of :meth:`read`, ``values`` the buffer they were packed into."""
        b, run = chunk
        first, spans = self._runs[run][:2]
        for j, (start, length) in enumerate(spans, first):
            rows = slice(start, start + length)
            torch.bmm(keys[rows].permute(1, 2, 0), values[0, rows].permute(1, 0, 2), out=summaries[b, j])

    def output(
        self,
        chunk: tuple[int, int],
        queries: torch.Tensor,
        mixed: torch.Tensor,
        out: torch.Tensor,
        result: torch.Tensor,
        eps: float,
    ) -> None:
        """The chunk's queries against their blocks' ``[S̃_o | z̃_o]`` (in ``out`` ``(1, H, R, Dv + 1)``, packed
        as the queries), the numerator divided by ``max(q · z̃, 0) + eps`` into the tokens' rows of ``result``."""
        b, run = chunk
        first, spans, tokens = self._runs[run]
        for j, (start, length) in enumerate(spans, first):
            if length:  # an empty block has no query
                rows = slice(start, start + length)
                torch.bmm(queries[rows].permute(1, 0, 2), mixed[b, j], out=out[0, :, rows])
        numerator = out[0, :, : len(tokens)].transpose(0, 1)  # (R_chunk, H, Dv + 1)
        denominator = numerator[..., -1:].clamp_min_(0).add_(eps)
        result[b].index_copy_(0, tokens, numerator[..., :-1].div_(denominator).to(result.dtype))


def _blocks_by_heads_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """``out[c, h] = a[c, h] @ b[c, h]`` (``+=`` with ``accumulate``) for ``(C, H, ...)`` operands whose
    (block, head) pairs are not one strided batch (the heads sit inside each token's row): one bmm per
    block, or per head when the blocks outnumber the heads."""
    if a.shape[0] <= a.shape[1]:
        pairs = [(a[i], b[i], out[i]) for i in range(a.shape[0])]
    else:
        pairs = [(a[:, h], b[:, h], out[:, h]) for h in range(a.shape[1])]
    for x, y, o in pairs:
        if accumulate:
            o.baddbmm_(x, y)
        else:
            torch.bmm(x, y, out=o)


def _mix_heads_last(mixing: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Σ_j W[o, j] x_j`` for every query block ``o``: ``x`` ``(B, M, H, X)`` -> ``(B, M_q, H, X)``, with W
    ``(M_q, M)`` shared by the heads or per-head ``(H, M_q, M)``. One bmm over the heads per batch entry,
    also for a shared W: on a CPU one product per head runs faster than one product over all heads' columns.
    """
    batch, _, heads, width = x.shape
    rows = mixing.expand(heads, *mixing.shape[-2:])
    out = _padded_rows((batch, rows.shape[1]), (heads, width), x.dtype, x.device)
    for i in range(batch):
        torch.bmm(rows, x[i].transpose(0, 1), out=out[i].transpose(0, 1))
    return out


def _padded_rows(lead: Sequence[int], row: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised ``(*lead, *row)`` tensor whose ``row`` parts lie one cache line (64 bytes) further apart
    than in a contiguous one.

    The per-head matrices cut out of it have the row stride ``prod(row)`` plus the pad; without it, when
    ``prod(row)`` bytes is a multiple of a large power of two (12 heads x 128 x 4 bytes = 6 KiB), their rows
    fall into a few cache sets and evict each other inside the products (at 21x30x50 with huge pages, where the
    placement is fixed, the operator took 280-289 ms without the pad and 227-233 ms with it).
    """
    width = math.prod(row)
    flat = torch.empty((*lead, width + 64 // dtype.itemsize), dtype=dtype, device=device)
    return flat[..., :width].unflatten(-1, tuple(row))
