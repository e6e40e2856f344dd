"""CPU allocator setting that matters for attention at video length.

glibc returns every freed block above 32 MiB to the operating system and faults it back in, page
by page, on the next allocation. An MHLA or linear-attention call at 31,500 tokens allocates several
such blocks, and on this project's 2-core machine the page faults cost more than the arithmetic
(0.38 s instead of about 1 s per call). Keeping freed memory for reuse removes that cost for every
operation in the process; PyTorch's CUDA caching allocator does the same on GPUs.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["retain_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Ask glibc to serve allocations below ``mmap_threshold`` bytes from its heap and keep freed memory.

    Process-wide and permanent for the process: memory that tensors release stays reserved for
    later tensors instead of going back to the system. Returns ``False`` (and changes nothing) where
    glibc is not the allocator, e.g. on macOS or Windows. Because it changes the whole process, only
    entry points call it (``mhla text-to-video`` / ``class-to-image`` / ``bench`` / ``build-embedded``
    and the web app's start, on CPU), never a library function.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
