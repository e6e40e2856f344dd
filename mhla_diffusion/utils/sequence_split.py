"""How a context-parallel run cuts the row-major token sequence into one contiguous range per process.

The rule is Diffusers' (``ContextParallelSplitHook``): ``torch.chunk`` by default, ``torch.tensor_split``
with ``ulysses_anything`` / ``ring_anything``. No torch import, so the command line can check a video
size against the number of processes before anything loads.
"""

from __future__ import annotations

__all__ = ["split_sizes"]


def split_sizes(total: int, parts: int, even: bool) -> tuple[int, ...]:
    """Tokens per process when ``total`` tokens are cut into ``parts`` contiguous ranges.

    ``even=True``: ``total / parts`` each (Diffusers' default split, ``torch.chunk``), which needs
    ``total % parts == 0``; ``even=False``: ``torch.tensor_split``'s rule (Diffusers'
    ``ulysses_anything`` / ``ring_anything``): the first ``total % parts`` ranges get one token more.
    """
    if parts < 1:
        raise ValueError(f"the number of processes must be >= 1, got {parts}")
    if total < parts:
        raise ValueError(
            f"cannot split {total} tokens across {parts} processes: every process needs at least one token"
        )
    if even:
        if total % parts:
            raise ValueError(
                f"{total} tokens do not split evenly across {parts} processes (Diffusers' default context-parallel "
                f"split needs N % P == 0): choose a video size whose token count is a multiple of {parts}, or enable "
                f"the uneven split (ContextParallelConfig(ulysses_anything=True) / ring_anything=True; "
                f"`--context-parallel-uneven` on the command line)"
            )
        return (total // parts,) * parts
    base, extra = divmod(total, parts)
    return tuple(base + (1 if r < extra else 0) for r in range(parts))
