"""CPU allocator setting that matters for attention at video length, applied by the library itself.

glibc returns every freed block above 32 MiB to the operating system and faults it back in, page
by page, on the next allocation. An MHLA or linear-attention call at 31,500 tokens allocates several
such blocks (gathered blocks, summaries, the output), and on this project's 2-core machine their
341,000 page faults cost as much as the arithmetic (MHLA 0.82 s per call instead of 0.41 s). Keeping
freed memory for reuse removes that cost for every operation in the process; PyTorch's CUDA caching
allocator does the same on GPUs.

So the first time :func:`~mhla_diffusion.ops.attention.mhla_attention` runs on a CPU tensor in a process
(directly, or through an MHLA attention processor), it calls :func:`retain_freed_memory` once and
logs that it did, in one line at debug level on the ``mhla_diffusion.ops.cpu_memory`` logger (it comes in
the middle of a table or a progress bar, so it stays out of a program's normal output). Setting the
environment variable ``MHLA_KEEP_MALLOC=1`` keeps glibc's settings untouched: then neither that
first use nor any entry point nor :func:`retain_freed_memory` changes the allocator. Under
``torch.compile`` the setting is not applied from inside the compiled graph.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = [
    "KEEP_MALLOC_ENV",
    "keep_malloc_requested",
    "malloc_retained",
    "retain_freed_memory",
    "retain_freed_memory_on_first_use",
]

logger = logging.getLogger(__name__)

#: Environment variable: ``1`` (any value but empty or ``0``) leaves glibc's malloc settings alone.
KEEP_MALLOC_ENV = "MHLA_KEEP_MALLOC"

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_retained = False  # this process changed the allocator (through retain_freed_memory)
_first_use_seen = False  # retain_freed_memory_on_first_use ran in this process


def keep_malloc_requested() -> bool:
    """Whether ``MHLA_KEEP_MALLOC`` asks the library to leave the allocator alone."""
    return os.environ.get(KEEP_MALLOC_ENV, "").strip() not in ("", "0")


def malloc_retained() -> bool:
    """Whether this process has already asked glibc to keep freed memory (by any caller of this module)."""
    return _retained


def retain_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Ask glibc to serve allocations below ``mmap_threshold`` bytes from its heap and keep freed memory.

    Process-wide and permanent for the process: memory that tensors release stays reserved for
    later tensors instead of going back to the system (``mallopt(M_MMAP_THRESHOLD, 1 GiB)`` and
    ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)``). The library calls it by itself on its first CPU
    attention call (:func:`retain_freed_memory_on_first_use`), and the CPU entry points call it at
    start; calling it again is harmless. Returns ``False`` (and changes nothing) where glibc is not
    the allocator, e.g. on macOS or Windows, and when ``MHLA_KEEP_MALLOC=1`` is set.
    """
    global _retained
    if keep_malloc_requested() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    done = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    _retained = _retained or done
    return done


def retain_freed_memory_on_first_use() -> bool:
    """Apply :func:`retain_freed_memory` once per process, on the first MHLA call on a CPU, and log it.

    Cheap after the first call (a flag check). Returns whether the allocator keeps freed memory now.
    """
    global _first_use_seen
    if _first_use_seen:
        return _retained
    _first_use_seen = True
    if _retained:  # an entry point (or the user) already did it
        return True
    if keep_malloc_requested():
        logger.debug(
            "mhla_diffusion: %s=%s is set: glibc's malloc settings stay as they are (large freed tensors are "
            "page-faulted in again on each CPU attention call)",
            KEEP_MALLOC_ENV,
            os.environ.get(KEEP_MALLOC_ENV),
        )
        return False
    if retain_freed_memory():
        logger.debug(
            "mhla_diffusion: glibc malloc now keeps freed memory for reuse (first MHLA call on a CPU), so large "
            "temporaries are not page-faulted in again; process-wide; %s=1 keeps glibc's defaults",
            KEEP_MALLOC_ENV,
        )
        return True
    return False
