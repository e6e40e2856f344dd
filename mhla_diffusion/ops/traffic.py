"""Memory traffic of one MHLA attention call, counted op by op on meta tensors.

Attention at video length is bound by memory, not arithmetic: the time of a call on a GPU is close to
the bytes it moves divided by the memory bandwidth. :class:`TrafficCounter` records, for every ATen op
a call dispatches, the bytes it reads (its tensor inputs) and writes (its tensor outputs); views,
reshapes and allocations move nothing and are skipped, and a broadcast (stride-0) input counts once.
Run on the ``meta`` device, nothing is allocated or computed, so Wan2.1-1.3B's 31,500-token layer is
counted in well under a second on any machine.

The unit is ``U = N x H x D x 2`` bytes, one bf16 tensor of queries. The floor of a call is what any
implementation must move: read ``q``, ``k``, ``v`` and write the output once (4 U), plus write and read
the float32 block summaries ``S_b`` and key sums ``z_b`` once (``2 x B x H x M x (D x Dv + D) x 4``
bytes). A fused kernel may keep the summaries on chip, so this floor is generous to it by that part.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TrafficCounter", "count_traffic", "dram_estimate", "floor_bytes", "tensor_bytes"]

#: In-place ops that overwrite their ``self`` without reading it.
_OVERWRITE_SELF = {"copy_", "fill_", "zero_"}

#: Ops that allocate or relabel memory without reading or writing tensor data.
_NO_TRAFFIC = {
    "empty",
    "empty_like",
    "empty_permuted",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "_unsafe_view",
    "detach",
    "alias",
    "lift_fresh",
    "lift_fresh_copy",
    "_local_scalar_dense",
    "set_",
    "resize_",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t``: a broadcast (stride-0) axis counts once."""
    distinct = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0)
    return (distinct if t.numel() else 0) * t.element_size()


@dataclass
class TrafficCounter(TorchDispatchMode):
    """Inside ``with TrafficCounter() as counter:``, every ATen op's bytes read and written are added up,
    in total and per op name (``counter.by_op``)."""

    read: int = 0
    written: int = 0
    by_op: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_TRAFFIC:
            return out
        # an `out=` argument is only written (an in-place op's `self` is read and written)
        outs = {id(kwargs[a.name]) for a in func._schema.arguments if a.is_out and a.name in kwargs}
        if name in _OVERWRITE_SELF:
            outs.add(id(args[0]))
        read = sum(
            tensor_bytes(t)
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and id(t) not in outs
        )
        written = sum(tensor_bytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.read += read
        self.written += written
        entry = self.by_op[name]
        entry[0] += 1
        entry[1] += read
        entry[2] += written
        return out

    @property
    def total(self) -> int:
        return self.read + self.written


def count_traffic(call: Callable[[], Any]) -> TrafficCounter:
    """Run ``call`` (on meta tensors, typically) under a :class:`TrafficCounter` and return it."""
    with torch.no_grad(), TrafficCounter() as counter:
        call()
    return counter


def floor_bytes(
    batch: int,
    tokens: int,
    heads: int,
    head_dim: int,
    value_dim: int,
    blocks: int,
    dtype: torch.dtype = torch.bfloat16,
    summaries: bool = True,
) -> int:
    """The least traffic of one MHLA call: ``q``, ``k``, ``v`` read and the output written once, in
    ``dtype``, plus (with ``summaries``) the float32 block summaries and key sums written and read once."""
    io = batch * tokens * heads * (2 * head_dim + 2 * value_dim) * dtype.itemsize
    kept = 2 * batch * heads * blocks * (head_dim * value_dim + head_dim) * 4 if summaries else 0
    return io + kept


#: The launch terms every head's programs read alike (the RoPE angle plan or tables, the plan's slot indices): a
#: GPU's L2 cache (50 MB on an H100 or H200; Wan2.1-1.3B's bf16 tables at 31,500 tokens are 8 MB) serves all reads
#: but the first from the chip.
SHARED_BY_HEADS = (": RoPE tables", ": RoPE angle plan", ": plan index")


def dram_estimate(terms: dict[str, int], heads: int) -> tuple[int, int]:
    """``(DRAM bytes, bytes L2 serves)`` of a fused launch's counted ``terms`` (``fused_traffic`` /
    ``fused_backward_traffic``) over ``heads`` heads: each term in :data:`SHARED_BY_HEADS` is read from DRAM once
    (``1 / heads`` of its count), the rest as counted."""
    served = sum(count * (heads - 1) // heads for name, count in terms.items() if name.endswith(SHARED_BY_HEADS))
    return sum(terms.values()) - served, served
