"""Communication of context-parallel MHLA vs Ulysses and ring attention, counted at the collectives.

    python -m mhla_diffusion.benchmarks.context_parallel --output /tmp/cp_bench.txt

Runs CPU processes (gloo) and counts every byte that enters and leaves a collective
(``torch.distributed`` and its functional collectives are wrapped while a layer runs), for one
Wan2.1-1.3B self-attention layer (12 heads x 128, bf16 activations) on the token grid of each video
size:

* **MHLA**: :func:`~mhla_diffusion.ops.context_parallel.mhla_attention_context_parallel` on real
  q, k, v of this process's tokens: one all-reduce of the block summaries (``H x M x D x Dv``; fp32,
  the default, and bf16 with the operator's ``reduce_dtype``). Layout 3x5x10 (150 blocks), released
  Wan setting (no denominator).
* **Ulysses** and **ring**: Diffusers' own context-parallel attention
  (``_templated_context_parallel_attention``) on real q, k, v of this process's tokens; only its local
  attention kernel is replaced by one returning zeros of the right shapes, so the collectives
  (all-to-all of q, k, v and the output; all-gather of k, v) run exactly as in a generation, with
  their real sizes, without the quadratic compute that a CPU could not finish at 32,760 tokens.
* **output gather**: Diffusers' all-gather of the transformer's output at ``proj_out`` (once per forward).

"Per step" is arithmetic on those counts: 30 layers x 2 forwards (classifier-free guidance) plus two
output gathers; the hybrid has 20 MHLA and 10 Ulysses layers. Bytes are per process ("in": what a
process hands to the collectives, "out": what it gets back).

Then the wall time of one forward of a narrower Wan-shaped MHLA transformer on a moderate grid, in
1 process and split across P processes, one CPU thread each, with the largest output difference.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ..models.context_parallel import context_parallel_config, cpu_parallel_config, run_cpu_processes
from ..ops.context_parallel import TokenShard, mhla_attention_context_parallel
from ..utils.geometry import video_token_grid
from ..utils.options import argparse_type

__all__ = ["count_collectives", "main"]

#: Wan2.1-1.3B: 30 blocks, 12 heads of 128, output channels x patch = 16 x 1 x 2 x 2.
LAYERS, HEADS, HEAD_DIM, OUT_CHANNELS = 30, 12, 128, 64
#: Transformer forwards per denoising step (classifier-free guidance: conditional and unconditional).
FORWARDS_PER_STEP = 2
LAYOUT = (3, 5, 10)


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


@contextlib.contextmanager
def count_collectives() -> Iterator[list[tuple[str, int, int]]]:
    """Record ``(collective, bytes in, bytes out)`` of every collective this process calls inside the block.

    Wraps ``torch.distributed.all_reduce`` / ``all_gather`` / ``send`` / ``recv`` / ``isend`` / ``irecv``
    and the functional ``all_to_all_single`` / ``all_gather_tensor`` / ``permute_tensor`` (what
    Diffusers' Ulysses, ring and gathers call), looked up by their callers at call time.
    """
    import torch.distributed._functional_collectives as funcol

    log: list[tuple[str, int, int]] = []
    patched: list[tuple[Any, str, Any]] = []

    def wrap(module: Any, name: str, inputs: Any, outputs: Any) -> None:
        original = getattr(module, name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            log.append((name, _nbytes(inputs(args, kwargs)), _nbytes(outputs(args, kwargs, result))))
            return result

        patched.append((module, name, original))
        setattr(module, name, counted)

    first = lambda args, kwargs: args[0]  # noqa: E731
    second = lambda args, kwargs: args[1]  # noqa: E731
    nothing = lambda *a: None  # noqa: E731
    wrap(dist, "all_reduce", first, lambda a, k, r: a[0])
    wrap(dist, "all_gather", second, lambda a, k, r: a[0])
    wrap(dist, "send", first, nothing)
    wrap(dist, "isend", first, nothing)
    wrap(dist, "recv", nothing, lambda a, k, r: a[0])
    wrap(dist, "irecv", nothing, lambda a, k, r: a[0])
    for name in ("all_to_all_single", "all_gather_tensor", "permute_tensor"):
        wrap(funcol, name, first, lambda a, k, r: r)
    try:
        yield log
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def _totals(log: list[tuple[str, int, int]]) -> tuple[int, int, list[str]]:
    return sum(entry[1] for entry in log), sum(entry[2] for entry in log), sorted({entry[0] for entry in log})


def _zero_attention(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> Any:
    """A local attention kernel with Diffusers' forward-op signature that computes nothing: zeros of the
    output's shape (and a log-sum-exp for ring attention)."""
    out = torch.zeros_like(query)
    if return_lse:
        return out, torch.zeros(query.shape[:3], dtype=torch.float32)
    return out


def _count_worker(frames: Sequence[int], height: int, width: int) -> dict[str, Any]:
    """Count one layer's collectives for every video size on this process group (every process runs it)."""
    from diffusers.hooks.context_parallel import EquipartitionSharder
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    warnings.filterwarnings("ignore", category=FutureWarning)  # funcol.all_gather_tensor's deprecation, from Diffusers
    world = dist.get_world_size()
    ulysses = cpu_parallel_config(context_parallel_config(world, softmax="ulysses"))
    ring = cpu_parallel_config(context_parallel_config(world, softmax="ring"))
    rows: dict[str, Any] = {}
    for count in frames:
        grid = video_token_grid(count, height, width)
        n = math.prod(grid)
        shard = TokenShard.split(n, even=n % world == 0)
        g = torch.Generator().manual_seed(dist.get_rank())
        q, k, v = (torch.rand(1, shard.num_local, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(3))
        measured: dict[str, Any] = {"grid": grid, "tokens": n, "local tokens": shard.num_local}
        for name, reduce_dtype in (("MHLA", None), ("MHLA, bf16 summaries", torch.bfloat16)):
            with torch.no_grad(), count_collectives() as log:
                mhla_attention_context_parallel(
                    q,
                    k,
                    v,
                    grid,
                    LAYOUT,
                    torch.eye(math.prod(LAYOUT)),
                    shard,
                    normalize="none",
                    reduce_dtype=reduce_dtype,
                )
            measured[name] = _totals(log)
        if n % world == 0:  # Diffusers' Ulysses / ring with the default (even) split
            for name, config in (("Ulysses", ulysses), ("ring", ring)):
                with torch.no_grad(), count_collectives() as log:
                    _templated_context_parallel_attention(
                        q,
                        k,
                        v,
                        None,
                        0.0,
                        False,
                        None,
                        False,
                        False,
                        forward_op=_zero_attention,
                        backward_op=None,
                        _parallel_config=config,
                    )
                measured[name] = _totals(log)
            with torch.no_grad(), count_collectives() as log:
                EquipartitionSharder.unshard(
                    torch.zeros(1, shard.num_local, OUT_CHANNELS, dtype=torch.bfloat16),
                    1,
                    ulysses.context_parallel_config._flattened_mesh,
                )
            measured["output gather"] = _totals(log)
        rows[f"{count}"] = measured
    return rows


def _timing_worker(grid: tuple[int, int, int], repeats: int, width: dict[str, int]) -> dict[str, Any]:
    """Median forward time of a Wan-shaped MHLA transformer on ``grid``, split across this group when it
    has more than one process; and the output, to compare with one process."""
    from diffusers import WanTransformer3DModel

    from ..config import MHLAConfig
    from ..models.context_parallel import enable_context_parallel
    from ..models.conversion import convert_to_mhla

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        in_channels=16,
        out_channels=16,
        text_dim=64,
        freq_dim=256,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        **width,
    ).eval()
    convert_to_mhla(model, MHLAConfig.released_wan(layout=LAYOUT))
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, grid[0], 2 * grid[1], 2 * grid[2], generator=g),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 16, 64, generator=g),
    )
    if dist.get_world_size() > 1:
        enable_context_parallel(model, dist.get_world_size())
    times = []
    with torch.no_grad():
        for step in range(repeats + 1):  # the first run warms up
            dist.barrier()
            start = time.perf_counter()
            out = model(**inputs, return_dict=False)[0]
            if step:
                times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "output": out}


def _mb(value: float) -> str:
    return f"{value / 1e6:,.1f}"


def _format(counts: dict[str, Any], processes: int, height: int, width: int) -> list[str]:
    lines = [
        f"Bytes per process, {processes} CPU processes (gloo), Wan2.1-1.3B self-attention (12 heads x 128, bf16 "
        f"activations), {height}x{width}, MHLA layout {'x'.join(map(str, LAYOUT))}; counted at the collectives.",
        f"Per step = {LAYERS} layers x {FORWARDS_PER_STEP} forwards (CFG) + {FORWARDS_PER_STEP} output gathers; "
        "hybrid = 20 MHLA + 10 Ulysses layers. MB = 10^6 bytes; in / out = handed to / returned by the collectives.",
        "",
        "| frames | tokens | method | per layer in (MB) | per layer out (MB) | per step in (MB) | per step out (MB) "
        "| collectives |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for frames, row in counts.items():
        gather = row.get("output gather", (0, 0, []))
        methods = [(name, row[name]) for name in ("MHLA", "MHLA, bf16 summaries", "Ulysses", "ring") if name in row]
        for name, (sent, received, ops) in methods:
            step_in, step_out = (FORWARDS_PER_STEP * (LAYERS * row[name][i] + gather[i]) for i in (0, 1))
            lines.append(
                f"| {frames} | {row['tokens']:,} | {name} | {_mb(sent)} | {_mb(received)} | {_mb(step_in)} | "
                f"{_mb(step_out)} | {', '.join(ops)} |"
            )
        if "Ulysses" in row:
            step_in, step_out = (
                FORWARDS_PER_STEP * (20 * row["MHLA"][i] + 10 * row["Ulysses"][i] + gather[i]) for i in (0, 1)
            )
            lines.append(
                f"| {frames} | {row['tokens']:,} | hybrid 2/3 (20 MHLA + 10 Ulysses) | | | {_mb(step_in)} | "
                f"{_mb(step_out)} | |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mhla_diffusion.benchmarks.context_parallel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--frames",
        type=argparse_type(list[int]),
        default=[17, 49, 81],
        help="video lengths, a list such as 17,49,81 (the default)",
    )
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument(
        "--processes", type=int, default=2, help="CPU processes of the count and the timing (default 2)"
    )
    parser.add_argument("--time-frames", type=int, default=17, help="video length of the wall-time row (0 skips it)")
    parser.add_argument(
        "--time-layers", type=int, default=2, help="transformer blocks of the wall-time model (default 2)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed forwards (median; after one warm-up)")
    parser.add_argument("--output", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.processes < 2:
        parser.error(f"--processes must be >= 2 (the split needs at least two processes), got {args.processes}")
    try:
        for frames in args.frames + ([args.time_frames] if args.time_frames else []):
            video_token_grid(frames, args.height, args.width)  # bad sizes fail here, before any process starts
    except ValueError as error:
        parser.error(str(error))

    counts = run_cpu_processes(_count_worker, args.processes, args.frames, args.height, args.width)[0]
    lines = _format(counts, args.processes, args.height, args.width)
    if args.time_frames:
        grid = video_token_grid(args.time_frames, args.height, args.width)
        width = dict(num_attention_heads=8, attention_head_dim=48, ffn_dim=1024, num_layers=args.time_layers)
        one = run_cpu_processes(_timing_worker, 1, grid, args.repeats, width)[0]
        split = run_cpu_processes(_timing_worker, args.processes, grid, args.repeats, width)
        diff = max(float((r["output"] - one["output"]).abs().max()) for r in split)
        lines += [
            "",
            f"Wall time of one forward, {args.time_layers}-block Wan-shaped MHLA transformer (8 heads x 48, FFN 1024, "
            f"fp32, layout {'x'.join(map(str, LAYOUT))}) on the {args.time_frames}x{args.height}x{args.width} grid "
            f"{'x'.join(map(str, grid))} ({math.prod(grid):,} tokens), one CPU thread per process, "
            f"median of {args.repeats}:",
            "",
            "| processes | seconds | largest output difference vs 1 process |",
            "|---:|---:|---:|",
            f"| 1 | {one['seconds']:.2f} | |",
            f"| {args.processes} | {statistics.median(r['seconds'] for r in split):.2f} | {diff:.1e} |",
        ]
    text = "\n".join(lines)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
