"""What every stage shares: the sizes (full and smoke), the loop timers (wall clock, CUDA events), the session file
and a stage's context."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

ROOT = Path(__file__).resolve().parents[2]


FORMAT = "mhla-gpu-session/2"
JSON_NAME, MARKDOWN_NAME = "gpu_session.json", "gpu_session.md"
DOC_SECTION = "cuda"
#: Relative error ‖out − ref‖ / ‖ref‖ a bf16 result may have (bf16 operands land between 1e-3 and 1e-2).
BF16_TOLERANCE = 1e-2
SDPA_KERNELS = ("flash", "cudnn", "efficient", "math")
#: The modules of FlashAttention-3 and -2 (each a row where it imports).
FA3_MODULE, FA2_MODULE = "flash_attn_interface", "flash_attn"
#: Where the fused MHLA path's custom op (item 1 of issue 49) and its fused backward (item 3) will live.
FUSED_OP_MODULE = "mhla_diffusion.ops.fused_op"
FUSED_BACKWARD_MODULE = "mhla_diffusion.ops.triton_mhla_backward"
#: Pieces of the fused Triton kernels' names (``_summaries_kernel``, ``_output_kernel``, and any MHLA kernel):
#: a profiled call's launches of these are the fused path's.
FUSED_KERNEL_MARKS = ("_summaries_kernel", "_output_kernel", "mhla")
#: Default seconds for all stages on a GPU (the wrapper's ``GPU_SESSION_BUDGET_S``).
DEFAULT_BUDGET_S = 400.0


@dataclass(frozen=True)
class LoopPlan:
    """How :func:`time_loops` times a set of methods.

    ``warmup`` untimed calls of each method, one timed call to size its loop, then ``repeats`` rounds, each a
    loop of ``calls`` back-to-back calls per method, ``calls = ceil(target_s / one call)`` kept within
    ``[min_calls, max_calls]`` (:func:`calls_for`)."""

    repeats: int
    warmup: int
    target_s: float
    min_calls: int
    max_calls: int


@dataclass(frozen=True)
class Sizes:
    """Every size a session uses: :data:`FULL` on a GPU, :data:`SMOKE` on a CPU."""

    heads: int
    head_dim: int
    layout: tuple[int, int, int]
    correctness_grids: dict[str, tuple[int, int, int]]
    timing_grids: tuple[tuple[int, int, int], ...]
    attention_loops: LoopPlan
    training_grids: tuple[tuple[int, int, int], ...]
    training_loops: LoopPlan
    transformer_grid: tuple[int, int, int]
    transformer_layout: tuple[int, int, int]
    transformer_layers: int
    transformer_dim: int
    transformer_heads: int
    transformer_ffn: int
    text_tokens: int
    transformer_loops: LoopPlan
    compile_backend: str
    #: The compiled models of the end-to-end stage, in order: ``"mhla paper"``, ``"sdpa"``, ``"mhla released"``.
    compile_targets: tuple[str, ...]
    #: Seconds a first compile is expected to take (later ones: 1.2 x the previous one), for skipping.
    compile_estimate_s: float


FULL = Sizes(
    heads=12,
    head_dim=128,
    layout=(3, 5, 10),
    correctness_grids={"even": (6, 10, 20), "uneven": (5, 7, 13), "empty blocks": (2, 4, 9)},
    timing_grids=((21, 30, 50), (21, 30, 52)),
    # a 21x30x50 MHLA call moves ~0.9 GB (~0.2-0.5 ms): loops of 50 ms are 100+ calls
    attention_loops=LoopPlan(repeats=10, warmup=3, target_s=0.05, min_calls=10, max_calls=500),
    training_grids=((21, 30, 50),),
    training_loops=LoopPlan(repeats=7, warmup=2, target_s=0.05, min_calls=5, max_calls=200),
    transformer_grid=(21, 30, 52),
    transformer_layout=(3, 5, 10),
    transformer_layers=30,
    transformer_dim=1536,
    transformer_heads=12,
    transformer_ffn=8960,
    text_tokens=512,
    # a forward is 0.1-1 s: loops of one or two forwards, events around each loop
    transformer_loops=LoopPlan(repeats=3, warmup=1, target_s=0.3, min_calls=1, max_calls=2),
    compile_backend="inductor",
    compile_targets=("mhla paper", "sdpa", "mhla released"),
    compile_estimate_s=90.0,
)
SMOKE = Sizes(
    heads=2,
    head_dim=16,
    layout=(3, 5, 10),
    correctness_grids={"even": (6, 5, 10), "uneven": (4, 7, 12), "empty blocks": (2, 4, 9)},
    timing_grids=((3, 5, 10), (3, 5, 12)),
    attention_loops=LoopPlan(repeats=2, warmup=1, target_s=0.002, min_calls=1, max_calls=3),
    training_grids=((3, 5, 10),),
    training_loops=LoopPlan(repeats=2, warmup=1, target_s=0.002, min_calls=1, max_calls=2),
    transformer_grid=(2, 4, 4),
    transformer_layout=(1, 2, 2),
    transformer_layers=2,
    transformer_dim=32,
    transformer_heads=2,
    transformer_ffn=64,
    text_tokens=4,
    transformer_loops=LoopPlan(repeats=1, warmup=1, target_s=0.001, min_calls=1, max_calls=1),
    compile_backend="aot_eager",  # Inductor's C++ build takes minutes on a small CPU
    compile_targets=("mhla paper", "sdpa"),
    compile_estimate_s=20.0,
)


# ----------------------------------------------------------------------------- timing loops


class Timer(Protocol):
    """What :func:`time_loops` times with: ``start()`` then ``stop()`` gives the seconds between them,
    device work included; ``sync()`` waits for the device."""

    name: str

    def sync(self) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> float: ...


class WallTimer:
    """The host's clock, after waiting for the device (``sync``) at both ends."""

    name = "wall clock around loops of calls"

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self._sync, self._started = sync, 0.0

    def sync(self) -> None:
        self._sync()

    def start(self) -> None:
        self._sync()
        self._started = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self._started


class CudaEventTimer:
    """A CUDA event recorded on the current stream at ``start()`` and one at ``stop()``, which waits for the
    second: device time of everything launched in between, without host synchronisation inside."""

    name = "CUDA events around loops of back-to-back calls"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start: torch.cuda.Event | None = None

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> float:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self._start.elapsed_time(end) / 1e3


def timer_for(device: torch.device) -> Timer:
    """CUDA events on a CUDA device, else the wall clock."""
    return CudaEventTimer(device) if device.type == "cuda" else WallTimer()


@dataclass
class LoopTiming:
    """``loops_s[i]``: seconds of round ``i``'s loop of ``calls`` back-to-back calls."""

    calls: int
    loops_s: list[float]

    @property
    def per_call_s(self) -> float:
        """Median loop time / calls."""
        return statistics.median(self.loops_s) / self.calls

    @property
    def spread(self) -> float:
        """Slowest loop / fastest loop (1.0: every round the same)."""
        return max(self.loops_s) / min(self.loops_s) if min(self.loops_s) > 0 else math.inf


def calls_for(one_call_s: float, plan: LoopPlan) -> int:
    """Back-to-back calls per timed loop: enough for ``plan.target_s`` at ``one_call_s`` a call, within
    ``[plan.min_calls, plan.max_calls]``."""
    if not one_call_s > 0:
        return plan.max_calls
    calls = math.ceil(round(plan.target_s / one_call_s, 6))  # rounded: 0.01 / 0.001 is 10, not 11
    return max(plan.min_calls, min(plan.max_calls, calls))


def time_loops(
    fns: dict[str, Callable[[], object]],
    timer: Timer,
    plan: LoopPlan,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, LoopTiming], dict[str, str]]:
    """Time each of ``fns`` as loops of back-to-back calls: ``({name: LoopTiming}, {name: error line})``.

    Per method: ``plan.warmup`` untimed calls, ``sync``, one timed call that sizes its loop
    (:func:`calls_for`). Then ``plan.repeats`` rounds; each times one loop per method, starting one method
    later than the round before (no method always runs first). A method that raises is left out with its
    error; the others go on. Grad mode is the caller's (wrap in ``torch.no_grad()`` for forwards)."""
    calls: dict[str, int] = {}
    errors: dict[str, str] = {}
    for name, fn in fns.items():
        log(f"{name} ...")
        try:
            for _ in range(plan.warmup):
                fn()
            timer.sync()
            timer.start()
            fn()
            calls[name] = calls_for(timer.stop(), plan)
        except Exception as error:  # a method that does not run here is a result, not a failure of the session
            errors[name] = _error_line(error)
    loops: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(plan.repeats):
        names = [name for name in loops if name not in errors]
        if not names:
            break
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            fn, n = fns[name], calls[name]
            try:
                timer.start()
                for _ in range(n):
                    fn()
                loops[name].append(timer.stop())
            except Exception as error:
                errors[name] = _error_line(error)
    timings = {name: LoopTiming(calls[name], times) for name, times in loops.items() if name not in errors and times}
    return timings, errors


def cuda_graph_replay(fn: Callable[[], object], device: torch.device, warmup: int = 2) -> Callable[[], None]:
    """One call of ``fn`` captured in a CUDA graph (after ``warmup`` calls on a side stream, as capture
    needs); returns the graph's ``replay``. Raises where ``fn`` cannot be captured (a host sync inside)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        fn()
    return graph.replay


# ----------------------------------------------------------------------------- the session file


def load_session(out: Path) -> dict[str, Any]:
    """The session JSON in ``out`` (``ValueError`` when it is not one)."""
    data = json.loads((out / JSON_NAME).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{out / JSON_NAME} is not a GPU session result (format {data.get('format')!r})")
    return data


def save_session(out: Path, session: dict[str, Any]) -> None:
    """Write the JSON (atomically: a run killed mid-write keeps the previous one) and its Markdown."""
    tmp = out / (JSON_NAME + ".tmp")
    tmp.write_text(json.dumps(session, indent=1, default=str))
    os.replace(tmp, out / JSON_NAME)
    from .report import render_markdown  # the report reads the stage list, which reads this module

    (out / MARKDOWN_NAME).write_text(render_markdown(session) + "\n")


@dataclass
class StageContext:
    """What a stage function gets: sizes, device, the stage's own JSON entry (``data``), ``save()`` and its
    ``deadline`` (``time.time()`` seconds; ``left()`` says how many remain)."""

    out: Path
    session: dict[str, Any]
    name: str
    sizes: Sizes
    device: torch.device
    smoke: bool
    deadline: float = math.inf

    @property
    def data(self) -> dict[str, Any]:
        return self.session["stages"][self.name]

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def timer(self) -> Timer:
        return timer_for(self.device)

    def left(self) -> float:
        """Seconds until this stage's deadline."""
        return self.deadline - time.time()

    def note(self, line: str) -> None:
        """A line for the reader (something skipped, and why)."""
        self.data.setdefault("notes", []).append(line)
        self.save()

    def save(self) -> None:
        save_session(self.out, self.session)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def log(self, line: str) -> None:
        print(f"[gpu_session {self.name}] {line}", file=sys.stderr, flush=True)

    def fused_runs(self, fused: Callable | None, what: str) -> bool:
        """Whether the fused kernel runs here: it imported, and the device is CUDA or Triton's CPU interpreter
        is on (``TRITON_INTERPRET=1``); otherwise notes why ``what`` was skipped."""
        if fused is None:
            return False
        return _interpreting() or self.cuda_only(what)

    def cuda_only(self, what: str) -> bool:
        """``True`` on CUDA; elsewhere notes that ``what`` was skipped and returns ``False``."""
        if self.device.type == "cuda":
            return True
        self.note(f"CUDA-only, skipped on {self.device.type}: {what}")
        return False


def _interpreting() -> bool:
    """Triton's CPU interpreter is on: the fused kernel runs on CPU tensors, with float32 dots (its bf16
    ``tl.dot`` is unreliable)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_dtype() -> torch.dtype | None:
    return torch.float32 if _interpreting() else None


def _error_line(error: BaseException, caught: list | None = None) -> str:
    """One line for an exception, with the warnings it came with (PyTorch says why a kernel refused there)."""
    first = (str(error).strip().splitlines() or [""])[0]
    reasons = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in caught or []))
    return f"{type(error).__name__}: {first}" + (f" ({reasons})" if reasons else "")


def _grid_label(grid: tuple[int, ...]) -> str:
    return "x".join(map(str, grid))
