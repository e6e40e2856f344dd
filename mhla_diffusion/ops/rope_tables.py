"""Wan's RoPE tables as the fused Triton kernels read them: each angle once (the even channels ``(N, D/2)``), in the
summaries' dtype, converted once per transformer forward (every layer gets the same two tables) and cached by
identity and write count (:class:`_RopeCache`), never while a CUDA graph is captured.
"""

from __future__ import annotations

import weakref

import torch

from ..utils.tensor_versions import write_count


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each angle of Diffusers' ``(1, N, 1, D)`` tables once: their even channels ``(N, D/2)`` in ``dtype``.
    Views when the tables are in ``dtype`` already; else contiguous copies (bf16 tables from Wan's float32
    ones: both kernels then read half the bytes, once per (batch x head) each), made once for the tables
    of a transformer forward (:func:`_converted_rope_tables`)."""
    return _converted_rope_tables(cos, sin, dtype)[0]


class _RopeCache:
    """The last RoPE tables converted, by identity: weak references to Wan's float32 ``cos``/``sin`` (the
    transformer passes the same two tensors to every layer of one forward), what identified their contents
    then (version counter, storage, shape, strides), the dtype, and the converted copy."""

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

    def get(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.entry is None:
            return None
        cos_ref, sin_ref, keys, cached_dtype, tables = self.entry
        if cos_ref() is not cos or sin_ref() is not sin or cached_dtype != dtype:
            return None
        now = (self._key(cos), self._key(sin))
        return tables if None not in now and now == keys else None

    def put(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, tables) -> None:
        keys = (self._key(cos), self._key(sin))
        self.entry = None if None in keys else (weakref.ref(cos), weakref.ref(sin), keys, dtype, tables)


_ROPE_CACHE = _RopeCache()


def _converted_rope_tables(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
    """:func:`_rope_tables` and whether this call converted them (a copy; ``False``: views of tables
    already in ``dtype``, or the copy an earlier call made of these very tensors, unchanged since: the same
    objects, version counters, storage, shape and strides). One cache entry, the last tables converted (it
    keeps their copy alive until other tables come); converted every call: inference tensors (no version
    counter) and tables seen while a CUDA graph is captured (replays refill the graph's inputs without
    Python, so a copy cached then could go stale)."""
    tables = (cos[0, :, 0, 0::2], sin[0, :, 0, 0::2])
    if all(t.dtype == dtype for t in tables):
        return tables, False
    if _capturing(cos.device):  # a CUDA graph's replays write its inputs with no version change: no cache
        return _convert_tables(tables, dtype), True
    cached = _ROPE_CACHE.get(cos, sin, dtype)
    if cached is not None:
        return cached, False
    converted = _convert_tables(tables, dtype)
    _ROPE_CACHE.put(cos, sin, dtype, converted)
    return converted, True


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _convert_tables(tables: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous copies of the even-channel tables ``(N, D/2)`` in ``dtype`` (one ``(2, N, D/2)`` tensor)."""
    out = torch.empty((2, *tables[0].shape), dtype=dtype, device=tables[0].device)
    out[0].copy_(tables[0])
    out[1].copy_(tables[1])
    return out[0], out[1]
