"""``mhla bench --stream-state``: what a stream's carried MHLA state weighs at real size, and what storing it narrower
costs in accuracy; and the memory traffic of one stream chunk, a row of ``mhla bench --traffic``.

Two tables, both computed here (nothing timed):

* **Size** at Wan2.1-1.3B 480p (30 layers, 12 heads of 128, 30x52 tokens a latent frame): the bytes of
  :class:`~mhla_diffusion.ops.causal.CausalMHLAState` built empty on the meta device for each layout and storage
  dtype (checked against ``L H S ((K + 1) D (Dv b + 4) + 4 [narrow])``, ``b`` bytes a stored number, float32 key
  sums, a narrow fold's scales), beside a bf16 softmax KV cache of every
  frame, a rolling cache of the last frames, and a window plus sink frames. ``smaller from`` is the length in latent
  frames from which the state is smaller than the full cache; ``vs the rolling cache``: its size over the rolling
  cache's (both constant once the video is longer than the window).
* **Error** of a narrower state: the same random stream run with the state stored in float32 and in the narrower
  dtype, one temporal block row per chunk; at rows 64, 256 and 1,024 the chunk's output of the narrow stream
  against the float32 stream's, as ``max |a - b| / max |b|``. For every fold (sum, mean, decay).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..config import MHLAConfig
from ..ops.causal import CausalMHLAState, causal_mixing_init, mhla_causal_step
from .bench import format_table

__all__ = [
    "STATE_DTYPES",
    "STREAM_TRAFFIC_SETTING",
    "stream_chunk_traffic",
    "state_error_rows",
    "state_report_markdown",
    "state_size_rows",
    "storage_error",
]

#: Storage dtypes of the tables, by name.
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Wan2.1-1.3B at 480p (832x480, latent 104x60, patch 2): layers, heads, head size, tokens per latent frame.
WAN_480P = dict(layers=30, heads=12, head_dim=128, frame_tokens=(30, 52))
#: The decay a ``causal_fold="decay"`` layer starts from (its fold weighs a row of age a by decay^a).
ERROR_DECAY = 0.9

SIZE_COLUMNS = (
    ("what", "carried", ""),
    ("layout", "blocks per frame", ""),
    ("dtype", "stored as", ""),
    ("mib", "MiB", ",.0f"),
    ("smaller_from", "smaller than the full bf16 KV cache from (latent frames)", ""),
    ("vs_rolling", "vs the rolling cache", ".2f"),
)
ERROR_COLUMNS = (
    ("fold", "fold", ""),
    ("dtype", "stored as", ""),
    ("bytes_vs_float32", "bytes vs float32", ".3f"),
    ("error_64", "error at 64 rows", ".1e"),
    ("error_256", "error at 256 rows", ".1e"),
    ("error_1024", "error at 1,024 rows", ".1e"),
)


def _state_bytes(layout: tuple[int, int], window: int, dtype: torch.dtype, model: dict[str, Any]) -> int:
    """Bytes of every layer's state, measured from an empty state on the meta device (and checked by the formula)."""
    s, d = math.prod(layout), model["head_dim"]
    state = CausalMHLAState.empty(1, model["heads"], window, s, d, d, summaries_dtype=dtype, device="meta")
    per_layer = state.nbytes
    narrow = dtype.itemsize < 4  # the fold in float16 with one float32 scale per block
    formula = model["heads"] * s * ((window + 1) * d * (d * dtype.itemsize + 4) + 4 * narrow)
    if per_layer != formula:
        raise AssertionError(f"state bytes {per_layer} differ from the formula's {formula}")
    return per_layer * model["layers"]


def state_size_rows(
    layouts: tuple[tuple[int, int], ...] = ((3, 5), (5, 9)),
    window: int = MHLAConfig.causal_window,
    rolling_frames: int = 21,
    sink_window: tuple[int, int] = (3, 12),
    model: dict[str, Any] = WAN_480P,
) -> list[dict[str, Any]]:
    """The size table's rows (module docstring): every layout x storage dtype, then the KV caches."""
    tokens = math.prod(model["frame_tokens"])
    kv_frame = model["layers"] * tokens * model["heads"] * 2 * model["head_dim"] * torch.bfloat16.itemsize
    rolling = rolling_frames * kv_frame
    rows = []
    for layout in layouts:
        for name in ("float32", "bfloat16"):
            size = _state_bytes(layout, window, STATE_DTYPES[name], model)
            rows.append(
                {
                    "what": f"MHLA state, K = {window}",
                    "layout": "x".join(map(str, layout)),
                    "dtype": name + (" (fold float16 scaled, key sums float32)" if name != "float32" else ""),
                    "mib": size / 2**20,
                    "smaller_from": str(math.floor(size / kv_frame) + 1),
                    "vs_rolling": size / rolling,
                }
            )
    sink, local = sink_window
    for what, frames in (
        ("bf16 KV cache, one latent frame", 1),
        (f"bf16 rolling KV cache, last {rolling_frames} latent frames", rolling_frames),
        (f"bf16 KV cache, {sink} sink + last {local} latent frames", sink + local),
    ):
        rows.append({"what": what, "layout": "", "dtype": "bfloat16", "mib": frames * kv_frame / 2**20})
    return rows


def storage_error(
    fold: str,
    dtypes: Sequence[torch.dtype],
    rows: tuple[int, ...] = (64, 256, 1024),
    *,
    heads: int = 2,
    layout: tuple[int, int] = (2, 2),
    tokens: tuple[int, int] = (4, 4),
    head_dim: int = 32,
    window: int = MHLAConfig.causal_window,
    seed: int = 0,
) -> dict[torch.dtype, dict[int, float]]:
    """Relative error of streams whose state is stored in each of ``dtypes`` against the float32 stream (run once
    for all), at each of ``rows`` (module docstring): ``{dtype: {row: max |a - b| / max |b|}}``. Random ``(1, N, H,
    D)`` inputs, one temporal block row of ``tokens`` (cut into ``layout`` blocks) per chunk, ReLU(x) + eps
    features, the initial causal mixing."""
    mixing = causal_mixing_init(layout, window)
    options = {"decay": ERROR_DECAY} if fold == "decay" else {"mean_fold": True} if fold == "mean" else {}
    grid, chunk_layout = (1, *tokens), (1, *layout)
    g = torch.Generator().manual_seed(seed)
    storages = (None, *dtypes)  # None: the float32 stream, first
    states: dict[torch.dtype | None, CausalMHLAState | None] = dict.fromkeys(storages)
    errors: dict[torch.dtype, dict[int, float]] = {dtype: {} for dtype in dtypes}
    for row in range(1, max(rows) + 1):
        q, k, v = (torch.randn(1, math.prod(tokens), heads, head_dim, generator=g) for _ in range(3))
        outs = {}
        for storage in storages:
            outs[storage], states[storage] = mhla_causal_step(
                q, k, v, grid, chunk_layout, mixing, states[storage], state_dtype=storage, feature_eps=1e-6, **options
            )
        if row in rows:
            for dtype in dtypes:
                errors[dtype][row] = ((outs[dtype] - outs[None]).abs().max() / outs[None].abs().max()).item()
    return errors


def state_error_rows(
    folds: tuple[str, ...] = ("sum", "mean", "decay"), dtypes: tuple[str, ...] = ("bfloat16", "float16"), **kwargs: Any
) -> list[dict[str, Any]]:
    """The error table's rows: every fold x narrow storage dtype (``kwargs``: :func:`storage_error`'s)."""
    model = dict(WAN_480P, layers=1)
    wide = _state_bytes((3, 5), MHLAConfig.causal_window, torch.float32, model)
    ratios = {name: _state_bytes((3, 5), MHLAConfig.causal_window, STATE_DTYPES[name], model) / wide for name in dtypes}
    rows = []
    for fold in folds:
        errors = storage_error(fold, [STATE_DTYPES[name] for name in dtypes], **kwargs)
        for name in dtypes:
            by_row = {f"error_{r}": e for r, e in errors[STATE_DTYPES[name]].items()}
            rows.append({"fold": fold, "dtype": name, "bytes_vs_float32": ratios[name], **by_row})
    return rows


def state_report_markdown(size_rows: list[dict[str, Any]], error_rows: list[dict[str, Any]]) -> str:
    """Both tables as Markdown, each with the line that says what it is."""
    model = WAN_480P
    return "\n".join(
        [
            f"`mhla bench --stream-state`. Size at Wan2.1-1.3B 480p ({model['layers']} layers, {model['heads']} heads "
            f"of {model['head_dim']}, {model['frame_tokens'][0]}x{model['frame_tokens'][1]} tokens a latent frame), "
            "batch 1, every layer:",
            "",
            format_table(size_rows, SIZE_COLUMNS),
            "",
            "Error of a state stored narrower, against the float32 state (max |a - b| / max |b| of the chunk's "
            "output; 2 heads of 32, 2x2 blocks of 2x2 tokens, one row a chunk, K = 2, decay fold at "
            f"{ERROR_DECAY}); bytes at 3x5 blocks, 12 heads of 128:",
            "",
            format_table(error_rows, ERROR_COLUMNS),
        ]
    )


#: The ``setting`` of the stream chunk's rows in ``mhla bench --traffic``.
STREAM_TRAFFIC_SETTING = "stream chunk: 3 latent frames, 3x5 blocks a frame, K = 2, denoising"


def stream_chunk_traffic(
    chunk_grid: tuple[int, int, int] = (3, 30, 52),
    blocks: tuple[int, int] = (3, 5),
    window: int = MHLAConfig.causal_window,
    *,
    heads: int = WAN_480P["heads"],
    head_dim: int = WAN_480P["head_dim"],
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    fused: bool = False,
) -> dict[str, Any]:
    """Bytes one denoising forward of a stream's chunk moves in a causal MHLA layer of Wan2.1-1.3B (the step from
    projected ``q, k, v`` against a float32 state several rows into its fold), counted on meta tensors: the eager
    operator op by op, or with ``fused`` the fused launch (:func:`~mhla_diffusion.ops.fused_causal.
    fused_causal_traffic`). A row of :data:`~mhla_diffusion.benchmarks.attention_traffic.TRAFFIC_COLUMNS`; its
    floor: ``q, k, v`` read and the output written once, the chunk's summaries written and read once, the carried
    state read once."""
    from ..ops.block_layout import block_plan
    from ..ops.traffic import floor_bytes
    from .attention_traffic import _traffic_row, count_path

    layout = (chunk_grid[0], *blocks)
    n, s = math.prod(chunk_grid), math.prod(blocks)
    meta = dict(device="meta")
    q, k, v = (torch.empty(batch, n, heads, head_dim, dtype=dtype, **meta) for _ in range(3))
    rotary = tuple(torch.empty(1, n, 1, head_dim, **meta) for _ in range(2))
    mixing = torch.empty((window + 2, s, s), **meta)
    state = CausalMHLAState.empty(batch, heads, window, s, head_dim, head_dim, **meta)
    state.rows = 4 * window  # older rows folded: the fold is mixed in as a stream carries it
    plan = block_plan(chunk_grid, layout, device="meta")

    def call() -> torch.Tensor:
        out, _ = mhla_causal_step(
            q, k, v, chunk_grid, layout, mixing, state, advance=False, plan=plan, feature_eps=1e-6,
            rotary=rotary, fused=fused,
        )  # fmt: skip
        return out

    items, launches = count_path(call, fused)
    carried = batch * heads * (window + 1) * s * (head_dim * head_dim + head_dim) * 4
    floor = floor_bytes(batch, n, heads, head_dim, head_dim, math.prod(layout), dtype) + carried
    unit = batch * n * heads * head_dim * dtype.itemsize
    return _traffic_row(chunk_grid, layout, dtype, unit, floor, items, launches, fused)
