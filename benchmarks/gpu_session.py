"""The GPU session of issues 34 and 49: what MHLA does on a lent GPU, measured in one call of under 10 minutes.

How to run it (one NVIDIA H200 is lent to some tasks: 15 minutes of device time per session, at most 10 per
command, the machine's start of one to two minutes included). The machine's image (device README, KINDS.md):
Python 3.12, torch 2.11 (CUDA 13) and Triton 3.6, no Diffusers, no FlashAttention-2 (``flash_attn``) or -3
(``flash_attn_interface``), no package registry. This tree travels with the call and is imported through
PYTHONPATH (no install); Diffusers is the one package to carry.

1. Here, once, before the call::

       bash benchmarks/gpu_session.sh --fetch-wheels

   saves Diffusers' wheel (the version installed here, 0.42.1: ``diffusers-0.42.1-py3-none-any.whl``, pure
   Python, about 6 MB) into ``benchmarks/wheels/``, which git ignores. Its needs (huggingface-hub >= 1.32,
   safetensors >= 0.8, numpy, regex, requests, filelock, Pillow) are in the image; nothing else is carried.
   (The tree that travels was about 24 MB on 2026-12-04; with the wheel it stays under the 64 MiB limit.)
2. One call of the device tool, from the repository root::

       run(command='set -o pipefail; bash benchmarks/gpu_session.sh "$OUT" 2>&1 | tee "$OUT/gpu_session.log"',
           carry=["benchmarks/wheels"], timeout_s=450)

   The wrapper installs the carried wheel into /tmp and gives the stages 400 s (``GPU_SESSION_BUDGET_S``)
   under an outer limit of 430 s. ``$OUT`` gets ``gpu_session.json`` and ``gpu_session.md`` (rewritten after
   every stage and row, so a cut run keeps what it measured) and the log; the reply's output_tail ends with
   the Markdown. With the machine's start the call stays under 10 minutes of device time, leaving about 5 of
   the session's 15 for a shorter second try (e.g. ``... gpu_session.sh "$OUT" --stages versions,timing``).
3. ``give_back``; copy ``gpu_session.json`` from the reply's files_at to
   ``benchmarks/results/gpu_session-YYYY-MM-DD.json``, then
   ``python benchmarks/gpu_session.py --report benchmarks/results/gpu_session-YYYY-MM-DD.json --write-doc
   docs/speed.md`` and commit both.

``python benchmarks/gpu_session.py OUT [--smoke]`` works too where this tree's packages are importable.

Stages, in the order they run. Each has a time limit and a share of the budget it needs to start
(:data:`STAGES`); a stage never takes the time the later ones need to start (:func:`stage_limit`,
:func:`plan_budget`), so the compile stage, third, cannot starve the timing stages and they cannot starve it.
On CUDA each stage runs in its own process under its limit (a kernel fault or a hung compile costs one stage).

``versions``     torch, CUDA, cuDNN, Triton, Diffusers, the GPU; which SDPA kernels run (flash, cuDNN,
                 memory-efficient, math, each alone), whether FlashAttention-2 / -3 import (without FA3,
                 cuDNN SDPA stands in for it), which MHLA paths exist (fused forward, its custom op
                 ``mhla_diffusion.ops.fused_op``, the fused backward ``mhla_diffusion.ops.triton_mhla_backward``);
                 the copy bandwidth and bf16 matmul rate.
``correctness``  bf16 on the device against float64 on the CPU, on even, uneven and empty-block grids, paper
                 and released settings, autocast off and on: the operator, the Wan processor's whole path
                 and the fused Triton kernel.
``endtoend``     a 30-block Wan2.1-1.3B-shaped transformer (random weights) at 21x30x52 tokens with 512 text
                 tokens: eager, stock per SDPA backend against MHLA paper (fused kernel, and with it switched
                 off: the eager operator) and released; then the converted transformer compiled by block
                 (``compile_repeated_blocks(fullgraph=True)``: one Wan block compiled, reused by all 30; MHLA
                 paper, stock, MHLA released, as long as the stage's time allows): compile time, compiled
                 against eager time and output, and which attention path the compiled graph holds
                 (:class:`GraphRecorder`: the MHLA custom op's calls, or none when Dynamo traced the eager
                 operator; the fused kernels' launches in one profiled compiled forward).
``gradients``    before the attention is timed: the fused bf16 forward and backward at the first timing grid
                 with signed mixing, output and ``dq, dk, dv, dW`` against a float32 eager reference, beside
                 the bf16 eager operator's errors (a row passes within 1.5x of eager's).
``timing``       attention forwards at 21x30x50 and 21x30x52 (B=1, H=12, D=128, bf16): the MHLA operator
                 (plan per call, precomputed, with RoPE), the Wan processor's path in both settings, the
                 fused kernel, a plain einsum linear attention, SDPA flash / cuDNN / memory-efficient,
                 FlashAttention-2 / -3 where they import; TF32 off and on; GB/s against the bytes counted on
                 meta tensors; each also replayed from a CUDA graph.
``training``     forward and forward + backward of the attention for fine-tuning (same shapes, inputs and
                 mixing requiring grad): the public fused entry ``mhla_attention_fused`` (whose autograd uses
                 the fused backward where one is registered, else recomputes eagerly), the eager operator,
                 SDPA's backward per kernel, FlashAttention-2 / -3; which kernels the fused backward launched.
``profile``      torch.profiler's top ops of one processor call and one fused call.
``families``     each model family's self-attention at its published size (``mhla bench --families``: Wan,
                 SkyReels-V2, HunyuanVideo, LTX-Video, CogVideoX, SANA-Video, Flux; the joint ones with their
                 text tokens), SDPA against global linear attention and the eager MHLA operator; last, on what
                 time is left, one family after the other.

Timing (:func:`time_loops`): after warm-up calls, each method is timed as a loop of back-to-back calls with one
pair of CUDA events around the whole loop (not around each sub-millisecond call, which would put the host's
launch time inside the window); the calls per loop are chosen so that a loop lasts about
``LoopPlan.target_s``; the loops of all methods are interleaved over ``repeats`` rounds; a row reports the
median loop time / calls and the spread (slowest / fastest loop). The attention rows are timed again as CUDA
graph replays (device time without host launches) where the call can be captured.

Compile choice: Diffusers' regional compilation, ``transformer.compile_repeated_blocks(fullgraph=True)``: every
``WanTransformerBlock`` is compiled with ``torch.compile``, and the 30 identical blocks share one compiled graph
(Dynamo treats their parameters as inputs), so a cold compile costs one block, not 30, and leaves the later
stages their time (issue 61); embeddings and the output head stay eager. In Inductor's default mode, not
``mode="max-autotune-no-cudagraphs"``. The GEMMs of a 1536-wide model at 32k tokens are large, and cuBLAS
runs them near the matmul ceiling already; max-autotune would benchmark Triton templates for every GEMM
shape on a cold machine, minutes of the lease for little, and leave no time for a comparison compile of the
stock model. CUDA graphs ("reduce-overhead") gain nothing on forwards of 0.1 s and more. ``fullgraph=True``
turns any graph break in a block into the row's error. The backend is Inductor wrapped in :class:`GraphRecorder`
(Dynamo's ``lookup_backend("inductor")``: what ``backend="inductor"`` compiles with in the default mode).

Then the Markdown (:func:`render_markdown`) goes into ``docs/speed.md`` between ``<!-- mhla-bench:cuda -->`` and
``<!-- /mhla-bench:cuda -->`` with ``--write-doc docs/speed.md`` (also from a saved JSON: ``--report``).

``--smoke`` runs every stage at tiny sizes on the CPU, in one process (the test suite does, in
``tests/bench/test_gpu_session.py``), timed by the wall clock around the same loops; parts that need CUDA are
skipped with a note saying so.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import mhla_diffusion from this tree
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mhla_diffusion.benchmarks.attention_traffic import (  # noqa: E402
    traffic_settings,
    wan_rotary_tables,
    wan_self_attention,
)
from mhla_diffusion.benchmarks.bench import format_table, plain_linear_attention, replace_marked_section  # noqa: E402

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


# ----------------------------------------------------------------------------- what runs here


def _package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _command_output(command: list[str]) -> str | None:
    """What ``command`` prints, or ``None`` when it is missing or fails (the GPU machine has no git tree)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def module_status(name: str) -> str:
    """``"imports"``, ``"not installed"``, or ``"fails to import: <error>"`` for module ``name``."""
    try:
        if importlib.util.find_spec(name) is None:
            return "not installed"
    except (ImportError, ValueError):
        return "not installed"
    try:
        importlib.import_module(name)
    except Exception as error:
        return f"fails to import: {_error_line(error)}"
    return "imports"


def _sdpa_kernel(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def run_sdpa(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch SDPA ``(B, H, N, D)`` restricted to one kernel (``flash``, ``cudnn``, ``efficient``, ``math``)."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_kernel(name)):
        return F.scaled_dot_product_attention(q, k, v)


def probe_sdpa(name: str, q: torch.Tensor) -> str:
    """``"ok"`` when SDPA's ``name`` kernel runs on ``q`` as query, key and value, else the error in one line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run_sdpa(name, q, q, q)
            return "ok"
        except Exception as error:  # a kernel missing here is a result, not a failure of the session
            return _error_line(error, caught)


def fa3_status() -> dict[str, str]:
    """Whether FlashAttention-3 imports, and what the session times in its place when it does not."""
    status = module_status(FA3_MODULE)
    if status == "imports":
        return {"flash_attn_interface": status, "stand_in": "none: FlashAttention-3 rows are its own"}
    return {
        "flash_attn_interface": status,
        "stand_in": "SDPA cuDNN (torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION)) stands in for "
        "FlashAttention-3, which is not importable here",
    }


def sdpa_method(kernel: str, fa3_imports: bool) -> str:
    """A row's name for SDPA's ``kernel``; cuDNN's says that it stands in for FlashAttention-3 where FA3 does
    not import."""
    return f"SDPA {kernel}" + (" (FA3 stand-in)" if kernel == "cudnn" and not fa3_imports else "")


def attention_baselines(
    heads_first: list[torch.Tensor], tokens_first: list[torch.Tensor], sizes: Sizes
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """The softmax attentions to time beside MHLA: SDPA's flash, cuDNN and memory-efficient kernels on
    ``heads_first`` ``q, k, v`` ``(B, H, N, D)``, and FlashAttention-3 / -2 on ``tokens_first`` ``(B, N, H, D)``
    where their modules import. Returns ``({name: call}, {name: why it does not run})``."""
    fa3 = module_status(FA3_MODULE) == "imports"
    calls: dict[str, Callable[[], object]] = {}
    errors: dict[str, str] = {}
    for kernel in SDPA_KERNELS[:3]:
        name = sdpa_method(kernel, fa3)
        status = probe_sdpa(kernel, heads_first[0][:, :, :256])
        if status != "ok":
            errors[name] = status
            continue
        calls[name] = lambda kernel=kernel, inputs=heads_first: run_sdpa(kernel, *inputs)
    if fa3:
        import flash_attn_interface

        calls["FlashAttention-3 (flash_attn_interface)"] = lambda: flash_attn_interface.flash_attn_func(*tokens_first)
    if module_status(FA2_MODULE) == "imports":
        import flash_attn

        calls["FlashAttention-2 (flash_attn)"] = lambda: flash_attn.flash_attn_func(*tokens_first)
    return calls, errors


def mhla_paths() -> dict[str, str]:
    """Which MHLA paths this tree has here: the fused forward, its custom op, the fused backward, and the
    MHLA ops registered with PyTorch's dispatcher."""
    fused, status = fused_kernel()
    paths = {
        "fused entry": status,
        f"custom op ({FUSED_OP_MODULE})": module_status(FUSED_OP_MODULE),
        f"fused backward ({FUSED_BACKWARD_MODULE})": module_status(FUSED_BACKWARD_MODULE),
    }
    try:
        ops = sorted(name for name in torch._C._dispatch_get_all_op_names() if "mhla" in name.lower())
    except Exception as error:  # a private listing: its absence is noted, not fatal
        ops = [f"(could not list: {_error_line(error)})"]
    paths["registered MHLA ops"] = ", ".join(ops) or "none"
    return paths


# ----------------------------------------------------------------------------- stage: versions


def stage_versions(ctx: StageContext) -> None:
    """Versions, the device, SDPA kernels and attention modules that run, MHLA's paths, and (CUDA) the copy
    and matmul ceilings."""
    ctx.data["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _package_version("triton"),
        "diffusers": _package_version("diffusers"),
        "commit": _command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
    }
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        smi = _command_output(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"]
        )
        ctx.data["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": props.total_memory / 2**30,
            "nvidia_smi": smi,
        }
    else:
        ctx.data["gpu"] = None
        ctx.data["cpu"] = f"{platform.machine()}, {torch.get_num_threads()} threads"
    ctx.save()
    probe = torch.randn(1, ctx.sizes.heads, 256, ctx.sizes.head_dim, device=ctx.device, dtype=ctx.dtype)
    ctx.data["sdpa_kernels"] = {name: probe_sdpa(name, probe) for name in SDPA_KERNELS}
    ctx.data["fa3"] = fa3_status()
    ctx.data["flash_attn"] = module_status(FA2_MODULE)
    ctx.data["mhla_paths"] = mhla_paths()
    ctx.save()
    if ctx.cuda_only("copy bandwidth and bf16 matmul ceilings"):
        ctx.data["ceilings"] = measure_ceilings(ctx.device)


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """A 2 GiB device-to-device copy (bytes read + written per second) and an 8192^3 bf16 matmul on random data,
    each timed as loops of calls (:func:`time_loops`)."""
    plan = LoopPlan(repeats=5, warmup=2, target_s=0.05, min_calls=5, max_calls=50)
    timer = CudaEventTimer(device)
    src = torch.randn(2**30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = time_loops({"copy": lambda: dst.copy_(src)}, timer, plan)[0]["copy"].per_call_s
    src = dst = None  # 4 GiB freed before the matmul's operands
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_s = time_loops({"matmul": lambda: a @ b}, timer, plan)[0]["matmul"].per_call_s
    return {"copy_gb_per_s": 2 * 2**31 / copy_s / 1e9, "bf16_matmul_tflop_per_s": 2 * 8192**3 / matmul_s / 1e12}


# ----------------------------------------------------------------------------- stage: correctness


def settings(layout: tuple[int, ...]) -> dict[str, Any]:
    """The paper and released settings (:func:`~mhla_diffusion.benchmarks.attention_traffic.traffic_settings`) on
    ``layout``."""
    return {name: dataclasses.replace(config, layout=layout) for name, config in traffic_settings().items()}


#: Where the public fused entry ``mhla_attention_fused`` is looked for: the custom op's module (what the
#: processors call; its autograd is the fused Triton backward).
FUSED_ENTRY_MODULES = (FUSED_OP_MODULE,)


def fused_kernel() -> tuple[Callable | None, str]:
    """The public fused entry ``mhla_attention_fused`` and ``"available (<module>)"``, or ``None`` and why not
    (:data:`FUSED_ENTRY_MODULES`, in order)."""
    problems = []
    for module in FUSED_ENTRY_MODULES:
        try:
            entry = importlib.import_module(module).mhla_attention_fused
        except Exception as error:
            problems.append(f"{module}: {_error_line(error)}")
            continue
        return entry, f"available ({module}.mhla_attention_fused)"
    return None, "not available: " + "; ".join(problems)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """‖out − ref‖ / ‖ref‖ in float64, the largest absolute error, and whether it passes for bf16."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    finite = bool(torch.isfinite(out).all())
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-300)) if finite else math.inf
    return {
        "rel_err": rel,
        "max_abs_err": float((out - ref).abs().max()) if finite else math.inf,
        "finite": finite,
        "ok": finite and rel < BF16_TOLERANCE,
    }


def _features(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.relu(x) + eps  # the Wan processor's feature map


def stage_correctness(ctx: StageContext) -> None:
    """bf16 on the device against float64 on the CPU: operator, processor path and (CUDA) fused kernel."""
    from mhla_diffusion.models.processors.base import apply_interleaved_rotary
    from mhla_diffusion.ops.attention import mhla_attention
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.naive import mhla_attention_reference

    sizes, device, dtype = ctx.sizes, ctx.device, ctx.dtype
    ctx.data.update(tolerance=BF16_TOLERANCE, reference="float64 on the CPU", checks=[])
    fused, fused_status = fused_kernel()
    ctx.data["fused"] = fused_status
    run_fused = ctx.fused_runs(fused, "the fused Triton kernel's checks")
    layout, eps = sizes.layout, 1e-6

    def check(kind: str, grid: tuple, setting: str, path: str, autocast: bool, out: torch.Tensor, ref: torch.Tensor):
        row = {
            "grid_kind": kind,
            "grid": "x".join(map(str, grid)),
            "setting": setting,
            "path": path,
            "autocast": autocast,
            **relative_error(out, ref),
        }
        ctx.data["checks"].append(row)

    def autocast(on: bool):
        return torch.autocast(device.type, dtype=dtype, enabled=on)

    for kind, grid in sizes.correctness_grids.items():
        n = math.prod(grid)
        g = torch.Generator().manual_seed(n)
        raw_q, raw_k, v = (torch.randn(1, n, sizes.heads, sizes.head_dim, generator=g).to(dtype) for _ in range(3))
        cos, sin = wan_rotary_tables(grid, sizes.head_dim, "cpu")
        layer_input = torch.randn(1, n, sizes.heads * sizes.head_dim, generator=g).to(dtype)
        for setting, config in settings(layout).items():
            mode = config.normalization
            per_head = setting == "released"  # per-head mixing on one setting, one shared matrix on the other
            m = math.prod(layout)
            mixing = torch.rand((sizes.heads, m, m) if per_head else (m, m), generator=g) * 0.1 + torch.eye(m)
            # operator: bf16 features and rotated features as a caller gives them, against the O(N^2) reference
            qf, kf = (_features(x.double(), eps) for x in (raw_q, raw_k))
            q_rot, k_rot = (apply_interleaved_rotary(x, cos.double(), sin.double()) for x in (qf, kf))
            args = [t.to(dtype) for t in (qf, kf, v, q_rot, k_rot)]
            ref = mhla_attention_reference(
                *[t.double() for t in args[:3]],
                grid,
                layout,
                mixing.double(),
                q_rot=args[3].double(),
                k_rot=args[4].double(),
                normalize=mode,
                eps=eps,
            )
            on_device = [t.to(device) for t in args]
            for on in (False, True):
                with torch.no_grad(), autocast(on):
                    out = mhla_attention(
                        *on_device[:3],
                        grid,
                        layout,
                        mixing.to(device),
                        q_rot=on_device[3],
                        k_rot=on_device[4],
                        normalize=mode,
                        eps=eps,
                    )
                check(kind, grid, setting, "operator", on, out, ref)
            # the processor's whole path, bf16 on the device against the same processor in float64
            processor, _ = wan_self_attention(
                grid, config, heads=sizes.heads, head_dim=sizes.head_dim, dtype=dtype, device=device, seed=n
            )
            with torch.no_grad():
                processor.mixing.copy_(mixing if processor.mixing.ndim == mixing.ndim else mixing.mean(0))
                if processor.out_norm is not None:
                    processor.out_norm.weight.copy_(1 + 0.1 * torch.randn(sizes.head_dim, generator=g))
            exact = copy.deepcopy(processor).to("cpu", torch.float64)
            inputs = (layer_input, raw_q, raw_k, v)
            with torch.no_grad():
                ref = exact.attend(*[t.double() for t in inputs], (cos.double(), sin.double()))
                for on in (False, True):
                    with autocast(on):
                        out = processor.attend(*[t.to(device) for t in inputs], (cos.to(device), sin.to(device)))
                    check(kind, grid, setting, "processor", on, out, ref)
            ctx.save()
            if run_fused:
                plan = block_plan(grid, layout, device)
                ref = mhla_attention_reference(
                    qf, kf, v.double(), grid, layout, mixing.double(), q_rot=q_rot, k_rot=k_rot, normalize=mode, eps=eps
                )
                for on in (False, True):
                    try:
                        with torch.no_grad(), autocast(on):
                            out = fused(
                                raw_q.to(device),
                                raw_k.to(device),
                                v.to(device),
                                plan,
                                mixing.to(device),
                                cos=cos.to(device),
                                sin=sin.to(device),
                                feature_eps=eps,
                                normalize=mode,
                                eps=eps,
                                dot_dtype=_dot_dtype(),
                            )
                        check(kind, grid, setting, "fused", on, out, ref)
                    except Exception as error:
                        ctx.data["checks"].append(
                            {
                                "grid_kind": kind,
                                "grid": "x".join(map(str, grid)),
                                "setting": setting,
                                "path": "fused",
                                "autocast": on,
                                "ok": False,
                                "error": _error_line(error),
                            }
                        )
                ctx.save()
    checks = ctx.data["checks"]
    ctx.data["passed"] = sum(c["ok"] for c in checks)
    ctx.data["failed"] = len(checks) - ctx.data["passed"]


#: A gradient row passes when the fused path's error is within this factor of the eager operator's (issue 61).
GRADIENT_FACTOR = 1.5


def stage_gradients(ctx: StageContext) -> None:
    """Gradients before the attention is timed (issue 61): at the first timing grid (Wan2.1-1.3B: 21x30x50, 12
    heads x 128, the paper layout) with signed mixing (the linear start plus noise, about 20 % negative, as
    fine-tuning can leave it), the output and every gradient (``dq, dk, dv, dW``) of the fused bf16 forward and
    backward and of the bf16 eager operator, each against a float32 eager reference on the device (largest error
    over largest value). A row passes when the fused error is within :data:`GRADIENT_FACTOR` of the eager one."""
    from mhla_diffusion.ops.attention import mhla_attention
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.mixing import mixing_init

    sizes, device = ctx.sizes, ctx.device
    grid, layout, eps = sizes.timing_grids[0], sizes.layout, 1e-6
    fused, status = fused_kernel()
    n = math.prod(grid)
    g = torch.Generator().manual_seed(61)
    raw = [torch.randn(1, n, sizes.heads, sizes.head_dim, generator=g) for _ in range(3)]
    cos, sin = wan_rotary_tables(grid, sizes.head_dim, device)
    start = mixing_init(layout)
    mixing = start + 3 * start.std() * torch.randn(start.shape, generator=g)  # about 20 % negative at 3x5x10
    weight = torch.randn(raw[2].shape, generator=g).to(device)
    ctx.data.update(
        grid=_grid_label(grid),
        layout=_grid_label(layout),
        heads=sizes.heads,
        head_dim=sizes.head_dim,
        dtype=str(ctx.dtype).removeprefix("torch."),
        negative_share=round(float((mixing < 0).float().mean()), 3),
        fused=status,
        factor=GRADIENT_FACTOR,
        rows=[],
    )

    def run(call: Callable, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [x.detach().to(device, dtype).clone().requires_grad_() for x in raw]
        w = mixing.detach().to(device).clone().requires_grad_()
        out = call(*leaves, w)
        (out.float() * weight).sum().backward()
        return [t.detach().float() for t in (out, *(x.grad for x in leaves), w.grad)]

    def eager(q, k, v, w):
        return mhla_attention(q, k, v, grid, layout, w, feature_eps=eps, eps=eps, rotary=(cos, sin))

    truth = run(eager, torch.float32)
    base = run(eager, ctx.dtype)
    got = None
    if ctx.fused_runs(fused, "the fused path's gradients"):
        plan = block_plan(grid, layout, device)

        def fused_call(q, k, v, w):
            return fused(q, k, v, plan, w, cos=cos, sin=sin, feature_eps=eps, eps=eps, dot_dtype=_dot_dtype())

        got = run(fused_call, ctx.dtype)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if torch.isfinite(a).all() else math.inf

    for index, name in enumerate(("out", "dq", "dk", "dv", "dW")):
        row = {"tensor": name, "eager": error(base[index], truth[index])}
        if got is not None:
            row["fused"] = error(got[index], truth[index])
            row["fused_over_eager"] = row["fused"] / max(row["eager"], 1e-30)
            row["ok"] = row["fused"] <= GRADIENT_FACTOR * row["eager"]
        ctx.data["rows"].append(row)
    ctx.data["failed"] = sum(not r.get("ok", True) for r in ctx.data["rows"])


# ----------------------------------------------------------------------------- attention calls


def operator_calls(
    grid: tuple[int, ...], sizes: Sizes, device: torch.device | str, dtype: torch.dtype
) -> dict[str, Callable]:
    """The MHLA operator's timed calls on ``grid`` (random inputs; empty ones on ``meta``, for counting bytes).

    Features are given in ``dtype`` (computed once, outside the timed call) except on the processor rows,
    which start from projected ``q, k, v`` as a Wan layer does."""
    from mhla_diffusion.models.processors.base import apply_interleaved_rotary
    from mhla_diffusion.ops.attention import mhla_attention
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.mixing import mixing_init

    device = torch.device(device)
    n, layout = math.prod(grid), sizes.layout
    shape = (1, n, sizes.heads, sizes.head_dim)
    if device.type == "meta":
        qf, kf, v = (torch.empty(shape, device=device, dtype=dtype) for _ in range(3))
        cos, sin = (torch.empty(1, n, 1, sizes.head_dim, device=device) for _ in range(2))
    else:
        g = torch.Generator().manual_seed(0)
        qf, kf = (torch.rand(shape, generator=g).to(device, dtype) for _ in range(2))  # non-negative features
        v = torch.randn(shape, generator=g).to(device, dtype)
        cos, sin = wan_rotary_tables(grid, sizes.head_dim, device)
    q_rot, k_rot = (apply_interleaved_rotary(x, cos, sin) for x in (qf, kf))
    plan = block_plan(grid, layout, device)
    mixing = mixing_init(layout).to(device)
    calls = {
        "MHLA operator, plan per call": lambda: mhla_attention(qf, kf, v, grid, layout, mixing),
        "MHLA operator, plan precomputed": lambda: mhla_attention(qf, kf, v, grid, layout, mixing, plan=plan),
        "MHLA operator + RoPE, plan precomputed": lambda: mhla_attention(
            qf, kf, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, plan=plan
        ),
        "plain linear attention (einsum)": lambda: plain_linear_attention(qf, kf, v),
    }
    for setting, config in settings(layout).items():
        _, call = wan_self_attention(
            grid, config, heads=sizes.heads, head_dim=sizes.head_dim, dtype=dtype, device=device
        )
        calls[f"Wan processor path, {setting} (feature map, RoPE{', norm, gate' if config.gate else ''})"] = call
    return calls


#: The rows timed again with TF32 matmuls (the operator accumulates bf16 inputs in float32 products).
TF32_ROWS = ("MHLA operator, plan precomputed", "Wan processor path, paper", "Wan processor path, released")


#: The rows that compute MHLA, whose bytes have MHLA's floor (:func:`~mhla_diffusion.ops.traffic.floor_bytes`).
MHLA_ROWS = ("MHLA operator", "Wan processor path", "fused Triton kernel")


def _at_precision(fn: Callable[[], object], tf32: bool) -> Callable[[], object]:
    def run() -> object:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        return fn()

    return run


def counted_bytes(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, fused: bool = False) -> dict[str, int]:
    """Bytes read and written by every call of :func:`operator_calls`, counted on meta tensors; with ``fused``
    (the fused kernels run on the timing device, so the processors take them) the processor rows' kernels
    counted from their launch."""
    from mhla_diffusion.benchmarks.attention_traffic import count_path

    calls = operator_calls(grid, sizes, "meta", dtype)
    return {name: sum(size for _, size in count_path(call, fused)[0].values()) for name, call in calls.items()}


def fused_bytes(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, normalize: str) -> int:
    """Bytes of one call of :func:`_fused_calls`'s kernel, counted from its launch."""
    return sum(fused_terms(grid, sizes, dtype, normalize).values())


def fused_dram_bytes(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, normalize: str) -> int:
    """:func:`fused_bytes` less what a GPU's L2 serves (the RoPE angle plan and slot indices every head reads again:
    :func:`~mhla_diffusion.ops.traffic.dram_estimate`)."""
    from mhla_diffusion.ops.traffic import dram_estimate

    return dram_estimate(fused_terms(grid, sizes, dtype, normalize), sizes.heads)[0]


def fused_terms(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, normalize: str) -> dict[str, int]:
    """The launch's counted terms (:func:`~mhla_diffusion.ops.triton_mhla.fused_traffic`)."""
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.triton_mhla import fused_traffic

    plan = block_plan(grid, sizes.layout)
    return dict(
        fused_traffic(
            1,
            math.prod(grid),
            sizes.heads,
            sizes.head_dim,
            sizes.head_dim,
            plan.num_blocks,
            plan.block_len,
            padded=plan.valid is not None,
            dtype=dtype,
            normalize=normalize,
        )
    )


def _fused_calls(
    fused: Callable, grid: tuple[int, ...], sizes: Sizes, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable]:
    """The fused kernel from projected ``q, k`` (feature map and RoPE inside), both normalisations."""
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.mixing import mixing_init

    n = math.prod(grid)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, sizes.heads, sizes.head_dim, generator=g).to(device, dtype) for _ in range(3))
    cos, sin = wan_rotary_tables(grid, sizes.head_dim, device)
    plan, mixing = block_plan(grid, sizes.layout, device), mixing_init(sizes.layout).to(device)
    return {
        _fused_name(mode): (
            lambda mode=mode: fused(q, k, v, plan, mixing, cos=cos, sin=sin, normalize=mode, dot_dtype=_dot_dtype())
        )
        for mode in FUSED_MODES
    }


#: The fused kernel's timed normalisations.
FUSED_MODES = ("denominator", "none")


def _fused_name(mode: str) -> str:
    return f"fused Triton kernel, {mode} (feature map, RoPE)"


# ----------------------------------------------------------------------------- profiler helpers


def kernel_counts(call: Callable[[], object], device: torch.device, limit: int = 20) -> dict[str, int]:
    """The device kernels one ``call`` launches, ``{name: launches}``, most launched first (names cut to 90
    characters, at most ``limit``). Off CUDA ``call`` runs once and the answer is ``{}``."""
    if device.type != "cuda":
        call()
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name[:90]] += 1
    return dict(counts.most_common(limit))


def fused_launches(kernels: dict[str, int]) -> int:
    """Launches of the fused MHLA kernels among ``kernels`` (:data:`FUSED_KERNEL_MARKS` in the name)."""
    return sum(n for name, n in kernels.items() if any(mark in name for mark in FUSED_KERNEL_MARKS))


# ----------------------------------------------------------------------------- stage: end to end


class GraphRecorder:
    """A ``torch.compile`` backend that counts what each graph Dynamo captures calls, then compiles it with
    the backend ``inner`` (``"inductor"``, or ``"aot_eager"`` in smoke runs): which attention the compiled
    model holds (the MHLA custom op, or the eager operator's ops traced in; SDPA)."""

    def __init__(self, inner: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.inner_name, self.inner = inner, lookup_backend(inner)
        self.graphs = 0
        self.calls: collections.Counter[str] = collections.Counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self.calls[op_name(node.target)] += 1
        return self.inner(gm, example_inputs)

    def summary(self) -> dict[str, Any]:
        """Graphs captured; calls of MHLA custom ops, of SDPA, and of every op outside ``aten``/``prims``."""
        custom = {
            name: n for name, n in self.calls.items() if "::" in name and name.split("::")[0] not in ("aten", "prims")
        }
        return {
            "graphs": self.graphs,
            "mhla_op_calls": sum(n for name, n in custom.items() if "mhla" in name.lower()),
            "sdpa_calls": sum(n for name, n in self.calls.items() if "scaled_dot_product" in name),
            "custom_ops": custom,
        }


def op_name(target: Any) -> str:
    """A graph node's target as ``namespace::op.overload`` for dispatcher ops, else its ``__name__``."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target.__name__}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return getattr(target, "__name__", None) or str(target)


def attention_path(target: str, summary: dict[str, Any], launches: int | None) -> str:
    """What attention a compiled model of ``target`` ran, from its graph ``summary`` and the fused kernels'
    ``launches`` in one profiled forward (``None``: not profiled, off CUDA)."""
    if target == "sdpa":
        path = f"SDPA ({summary['sdpa_calls']} calls in the graph)"
    elif summary["mhla_op_calls"]:
        path = f"MHLA custom op kept in the graph ({summary['mhla_op_calls']} calls)"
    else:
        path = "eager MHLA operator traced into the graph (no MHLA custom op)"
    return path + ("" if launches is None else f"; {launches} fused kernel launches per forward")


@contextlib.contextmanager
def fused_switch(on: bool) -> Iterator[None]:
    """The fused Triton path on or off (``mhla_diffusion.ops.triton_mhla.FUSED``) inside the block."""
    from mhla_diffusion.ops import triton_mhla

    before = triton_mhla.FUSED
    triton_mhla.FUSED = on
    try:
        yield
    finally:
        triton_mhla.FUSED = before


def build_wan(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A Wan2.1-T2V-1.3B-shaped ``WanTransformer3DModel`` (``sizes``' layers, width, heads, FFN) with random
    weights built on ``device`` in ``dtype`` (float32 where Diffusers keeps it), and the keyword inputs of one
    forward: latents ``(1, 16, F, 2 H, 2 W)`` for the token grid ``(F, H, W)``, ``text_tokens`` text embeddings
    ``(1, T, 4096)``, timestep 500."""
    from diffusers import WanTransformer3DModel

    from mhla_diffusion.benchmarks.bench import _cast_like_from_pretrained
    from mhla_diffusion.utils.wan_configs import wan_transformer_config

    config = wan_transformer_config("Wan2.1-T2V-1.3B")
    config.update(
        num_layers=sizes.transformer_layers,
        num_attention_heads=sizes.transformer_heads,
        attention_head_dim=sizes.transformer_dim // sizes.transformer_heads,
        ffn_dim=sizes.transformer_ffn,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = _cast_like_from_pretrained(WanTransformer3DModel(**config).eval(), dtype)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(
        1, config["in_channels"], *(n * p for n, p in zip(sizes.transformer_grid, config["patch_size"])), generator=g
    )
    text = torch.randn(1, sizes.text_tokens, config["text_dim"], generator=g)
    inputs = dict(
        hidden_states=latents.to(device, dtype),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=text.to(device, dtype),
        return_dict=False,
    )
    return model, inputs


def _relative_difference(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def stage_endtoend(ctx: StageContext) -> None:
    """The Wan2.1-1.3B-shaped transformer: eager rows (stock per SDPA backend, MHLA paper with the fused kernel
    and with the eager operator, MHLA released), then the whole model under ``torch.compile(fullgraph=True)``
    for each of ``sizes.compile_targets`` while the stage's time allows."""
    if _package_version("diffusers") is None:
        ctx.note("Diffusers is not installed here (see the header of benchmarks/gpu_session.py on carrying its wheel)")
        return
    from mhla_diffusion.benchmarks.bench import PeakMemory, _sdpa_backends
    from mhla_diffusion.models.conversion import convert_to_mhla, get_mhla_conversion, revert_mhla, softmax_attention

    sizes, device = ctx.sizes, ctx.device
    model, inputs = build_wan(sizes, device, ctx.dtype)
    backends = _sdpa_backends(device, None)
    fa3 = "_flash_3" in backends
    configs = {
        f"mhla {name}": dataclasses.replace(config, layers="all")
        for name, config in settings(sizes.transformer_layout).items()
    }
    ctx.data.update(
        grid=_grid_label(sizes.transformer_grid),
        layout=_grid_label(sizes.transformer_layout),
        layers=sizes.transformer_layers,
        text_tokens=sizes.text_tokens,
        dim=sizes.transformer_dim,
        weights_mb=sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20,
        backends=backends,
        cross_attention="native",
        timer=ctx.timer.name,
        forwards_per_video=100,
        rows=[],
        compiled=[],
        compile_backend=sizes.compile_backend,
        compile_call="transformer.compile_repeated_blocks(fullgraph=True, "
        f"backend=GraphRecorder({sizes.compile_backend!r}))"
        + (", Inductor's default mode" if sizes.compile_backend == "inductor" else ""),
    )
    if sizes.compile_backend != "inductor":
        ctx.note(f"compile backend {sizes.compile_backend} instead of Inductor: a smoke run on a small CPU")
    ctx.save()

    def set_state(target: str) -> None:
        if get_mhla_conversion(model) is not None:
            revert_mhla(model)
        if target != "sdpa":
            convert_to_mhla(model, configs[target])

    def forward(backend: str, stock: bool = False, fused: bool = True) -> Callable[[], object]:
        def run() -> object:
            with softmax_attention(model) if stock else contextlib.nullcontext(), fused_switch(fused):
                model.set_attention_backend(backend)  # the softmax layers' backend (MHLA processors have none)
                return model(**inputs)[0]

        return run

    def stock_name(backend: str) -> str:
        return f"sdpa ({backend}{', FA3 stand-in' if backend == '_native_cudnn' and not fa3 else ''})"

    # eager: stock and MHLA paper interleaved, then MHLA released
    groups = [
        (
            "mhla paper",
            {stock_name(b): (forward(b, stock=True), f"SDPA {b}") for b in backends}
            | {
                "mhla paper": (forward("native"), "MHLA, fused kernels where they run"),
                "mhla paper, eager operator": (forward("native", fused=False), "MHLA eager operator (fused off)"),
            },
        ),
        ("mhla released", {"mhla released": (forward("native"), "MHLA, fused kernels where they run")}),
    ]
    for target, methods in groups:
        set_state(target)
        with torch.no_grad():
            timings, errors = time_loops(
                {name: call for name, (call, _) in methods.items()}, ctx.timer, sizes.transformer_loops, ctx.log
            )
        for name, (call, what) in methods.items():
            row: dict[str, Any] = {"method": name, "attention": what}
            if name in timings:
                with torch.no_grad(), PeakMemory(device) as memory:
                    kernels = kernel_counts(call, device)
                row.update(
                    calls=timings[name].calls,
                    median_s=timings[name].per_call_s,
                    spread=timings[name].spread,
                    video_s=100 * timings[name].per_call_s,  # 50 steps, a conditional and an unconditional forward
                    peak_extra_mb=memory.peak / 2**20,
                    fused_launches=fused_launches(kernels) if device.type == "cuda" else None,
                )
            else:
                row.update(median_s=None, error=errors.get(name, "not timed"))
            ctx.data["rows"].append(row)
        ctx.save()
    stock = [r["median_s"] for r in ctx.data["rows"] if r["method"].startswith("sdpa (") and r["median_s"]]
    for row in ctx.data["rows"]:
        if row["method"].startswith("mhla") and row["median_s"] and stock:
            row["sdpa_over_mhla"] = min(stock) / row["median_s"]
    ctx.save()

    # the transformer compiled by block, one target at a time while the stage's time allows
    estimate = sizes.compile_estimate_s
    for target in sizes.compile_targets:
        row = {"setting": target}
        if ctx.left() < estimate:
            row["error"] = f"skipped: {ctx.left():.0f} s of the stage left, a compile takes about {estimate:.0f} s"
            ctx.data["compiled"].append(row)
            ctx.save()
            continue
        ctx.log(f"compiling {target} ({ctx.left():.0f} s left)")
        row["error"] = "did not finish: the stage was stopped at its time limit during this compile or its timing"
        ctx.data["compiled"].append(row)
        ctx.save()
        try:
            set_state(target)
            model.set_attention_backend("native")
            torch._dynamo.reset()
            recorder = GraphRecorder(sizes.compile_backend)
            compiled = copy.deepcopy(model)  # the eager model stays as it is, for the comparison
            compiled.compile_repeated_blocks(fullgraph=True, backend=recorder)
            started = time.perf_counter()
            with torch.no_grad():
                out = compiled(**inputs)[0]
            ctx.sync()
            row["compile_s"] = time.perf_counter() - started
            estimate = 1.2 * row["compile_s"] + 10
            summary = recorder.summary()
            row.update(summary)
            with torch.no_grad():
                row["rel_diff_vs_eager"] = _relative_difference(out, model(**inputs)[0])
                kernels = kernel_counts(lambda: compiled(**inputs), device)
            launches = fused_launches(kernels) if device.type == "cuda" else None
            row.update(attention_path=attention_path(target, summary, launches), fused_launches=launches)
            ctx.save()
            with torch.no_grad():
                timings, errors = time_loops(
                    {"eager": lambda: model(**inputs), "compiled": lambda: compiled(**inputs)},
                    ctx.timer,
                    sizes.transformer_loops,
                    ctx.log,
                )
            del row["error"]
            if errors:
                row["error"] = "; ".join(f"{name}: {line}" for name, line in errors.items())
            if len(timings) == 2:
                eager_s, compiled_s = timings["eager"].per_call_s, timings["compiled"].per_call_s
                row.update(eager_s=eager_s, compiled_s=compiled_s, eager_over_compiled=eager_s / compiled_s)
        except Exception as error:
            row["error"] = _error_line(error)
            ctx.log(traceback.format_exc()[-2000:])
        ctx.save()
        compiled = None
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- stage: attention timing


def attention_calls(
    grid: tuple[int, ...], sizes: Sizes, device: torch.device, dtype: torch.dtype, fused: Callable | None, tf32: bool
) -> tuple[dict[str, Callable[[], object]], dict[str, int], dict[str, str], dict[str, str]]:
    """Every attention forward the timing stage times on ``grid``: ``(calls, bytes of each call, what those
    bytes are, {method: why it does not run})``. The MHLA operator and processor rows (:func:`operator_calls`;
    again with TF32 matmuls when ``tf32``), SDPA and FlashAttention (:func:`attention_baselines`), and last the
    fused kernel when ``fused`` is given (a fault in the new kernel then loses only its own rows)."""
    n = math.prod(grid)
    unit = n * sizes.heads * sizes.head_dim * torch.empty((), dtype=dtype).element_size()
    bytes_of = counted_bytes(grid, sizes, dtype, fused=fused is not None)
    plain = operator_calls(grid, sizes, device, dtype)
    calls = {name: _at_precision(call, False) for name, call in plain.items()}
    basis = dict.fromkeys(calls, "counted")
    if tf32:
        for name in [c for c in plain if c.startswith(TF32_ROWS)]:
            calls[f"{name}, TF32"] = _at_precision(plain[name], True)
            bytes_of[f"{name}, TF32"], basis[f"{name}, TF32"] = bytes_of[name], "counted"
    g = torch.Generator().manual_seed(1)
    heads_first = [torch.randn(1, sizes.heads, n, sizes.head_dim, generator=g).to(device, dtype) for _ in range(3)]
    tokens_first = [t.transpose(1, 2).contiguous() for t in heads_first]
    baselines, errors = attention_baselines(heads_first, tokens_first, sizes)
    for name, call in baselines.items():
        calls[name] = _at_precision(call, False)
        bytes_of[name], basis[name] = 4 * unit, "q, k, v, out once"
    if fused is not None:
        for name, call in _fused_calls(fused, grid, sizes, device, dtype).items():
            calls[name] = call
            mode = name.split(", ")[1].split()[0]
            bytes_of[name], basis[name] = fused_bytes(grid, sizes, dtype, mode), "counted from the launch"
            bytes_of[f"{name}, DRAM"] = fused_dram_bytes(grid, sizes, dtype, mode)
    return calls, bytes_of, basis, errors


#: The rows the timing stage times first on each grid (and saves), before the rest: what a reader looks for.
HEADLINE_ROWS = ("SDPA flash", "SDPA cuDNN", "Wan processor path, paper", _fused_name("denominator"))


def headline_first(names: list[str]) -> tuple[list[str], list[str]]:
    """``names`` split into the headline rows (:data:`HEADLINE_ROWS`, by prefix) and the rest, each in order."""
    headline = [name for name in names if name.startswith(HEADLINE_ROWS)]
    return headline, [name for name in names if name not in headline]


def stage_timing(ctx: StageContext) -> None:
    """Device time of every attention forward on each timing grid (loops of calls), GB/s against the counted
    bytes; the headline rows (:data:`HEADLINE_ROWS`) of a grid are timed first and saved before its other rows,
    so a stage cut short keeps them; then (CUDA) every timed call again as CUDA graph replays, after all grids'
    loops, so that a capture that upsets the device costs only graph columns."""
    from mhla_diffusion.ops.traffic import floor_bytes

    sizes, device, dtype = ctx.sizes, ctx.device, ctx.dtype
    plan = sizes.attention_loops
    ctx.data.update(
        rows=[],
        dtype=str(dtype).removeprefix("torch."),
        heads=sizes.heads,
        head_dim=sizes.head_dim,
        layout=_grid_label(sizes.layout),
        repeats=plan.repeats,
        timer=ctx.timer.name,
        fa3=fa3_status(),
    )
    fused, ctx.data["fused"] = fused_kernel()
    tf32 = ctx.cuda_only("the TF32 rows")
    graphs = ctx.cuda_only("the CUDA graph replays")
    fused = fused if ctx.fused_runs(fused, "the fused Triton kernel's rows") else None
    timed: dict[tuple[int, ...], dict[str, dict[str, Any]]] = {}
    for grid in sizes.timing_grids:
        n, label = math.prod(grid), _grid_label(grid)
        unit = n * sizes.heads * sizes.head_dim * torch.empty((), dtype=dtype).element_size()
        floor = floor_bytes(1, n, sizes.heads, sizes.head_dim, sizes.head_dim, math.prod(sizes.layout), dtype)
        calls, bytes_of, basis, errors = attention_calls(grid, sizes, device, dtype, fused, tf32)
        timed[grid] = {}
        for group in headline_first(list(calls)):
            if not group:
                continue
            with torch.no_grad():
                timings, failed = time_loops({name: calls[name] for name in group}, ctx.timer, plan, ctx.log)
            errors.update(failed)
            torch.set_float32_matmul_precision("highest")
            _timing_rows(ctx, calls, timings, timed[grid], label, n, unit, floor, bytes_of, basis)
            ctx.save()
        for name, error in errors.items():
            ctx.data["rows"].append({"grid": label, "tokens": n, "method": name, "median_ms": None, "error": error})
        ctx.data.setdefault("floor_units", {})[label] = floor / unit
        ctx.save()
        del calls
    if not graphs:
        return
    _graph_replays(ctx, timed, sizes, device, dtype, fused, tf32, plan)


def _timing_rows(
    ctx: StageContext,
    calls: dict[str, Callable[[], object]],
    timings: dict[str, Any],
    timed: dict[str, dict[str, Any]],
    label: str,
    n: int,
    unit: int,
    floor: int,
    bytes_of: dict[str, int],
    basis: dict[str, str],
) -> None:
    """One timing row per timed method (its peak memory measured by one more call), into ``ctx`` and ``timed``."""
    from mhla_diffusion.benchmarks.bench import PeakMemory

    for name, timing in timings.items():
        seconds = timing.per_call_s
        with torch.no_grad(), PeakMemory(ctx.device) as memory:
            calls[name]()
        torch.set_float32_matmul_precision("highest")
        row = {
            "grid": label,
            "tokens": n,
            "method": name,
            "calls": timing.calls,
            "median_ms": seconds * 1e3,
            "spread": timing.spread,
            "counted_units": bytes_of[name] / unit,
            "bytes_basis": basis[name],
            "gb_per_s": bytes_of[name] / seconds / 1e9,
            "dram_units": bytes_of[f"{name}, DRAM"] / unit if f"{name}, DRAM" in bytes_of else None,
            "dram_gb_per_s": bytes_of[f"{name}, DRAM"] / seconds / 1e9 if f"{name}, DRAM" in bytes_of else None,
            "floor_gb_per_s": floor / seconds / 1e9 if name.startswith(MHLA_ROWS) else None,
            "peak_extra_mb": memory.peak / 2**20,
        }
        timed[name] = row
        ctx.data["rows"].append(row)


def _graph_replays(ctx, timed, sizes, device, dtype, fused, tf32, plan) -> None:
    """The timed calls replayed from a CUDA graph: device time without the host's launches."""
    replay_plan = dataclasses.replace(plan, repeats=max(3, plan.repeats // 2), warmup=1)
    for grid, rows in timed.items():
        calls = attention_calls(grid, sizes, device, dtype, fused, tf32)[0]
        for name, row in rows.items():
            try:
                replay = cuda_graph_replay(calls[name], device)
                graph_timing, graph_errors = time_loops({name: replay}, ctx.timer, replay_plan)
                if name in graph_timing:
                    row["graph_ms"] = graph_timing[name].per_call_s * 1e3
                else:
                    row["graph_error"] = graph_errors[name]
            except Exception as error:
                row["graph_error"] = _error_line(error)
            replay = None
            torch.set_float32_matmul_precision("highest")
        ctx.save()
        del calls


# ----------------------------------------------------------------------------- stage: training (backward)


def _first(out: Any) -> torch.Tensor:
    """The output tensor of an attention call (FlashAttention-3 may return ``(out, lse)``)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def training_calls(
    grid: tuple[int, ...], sizes: Sizes, device: torch.device, dtype: torch.dtype, fused: Callable | None
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """For each attention to fine-tune with: its forward with grad on and its forward + backward, as
    ``{"<method> | forward": call, "<method> | forward + backward": call}``, and ``{method: why not}``.

    MHLA starts from raw ``q, k, v`` ``(1, N, H, D)`` with the feature map and RoPE inside, and a ``(M, M)``
    mixing in float32; all four require grad (``torch.autograd.grad`` of the output with a fixed random
    output gradient). ``fused`` is the public fused entry (``mhla_attention_fused``; its autograd is the
    fused backward where one is registered) or ``None``. SDPA and FlashAttention-2/-3 take ``q, k, v``."""
    from mhla_diffusion.ops.attention import mhla_attention
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.mixing import mixing_init

    n = math.prod(grid)
    g = torch.Generator().manual_seed(3)
    shape = (1, n, sizes.heads, sizes.head_dim)
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, generator=g).to(device, dtype)
    cos, sin = wan_rotary_tables(grid, sizes.head_dim, device)
    plan = block_plan(grid, sizes.layout, device)
    mixing = (mixing_init(sizes.layout) + 0.01 * torch.rand(plan.num_blocks, plan.num_blocks, generator=g)).to(device)
    mixing.requires_grad_()
    mhla_inputs = (q, k, v, mixing)

    def pair(name: str, forward: Callable[[], torch.Tensor], inputs: tuple, grad: torch.Tensor) -> None:
        calls[f"{name} | forward"] = forward
        calls[f"{name} | forward + backward"] = lambda: torch.autograd.grad(_first(forward()), inputs, grad)

    calls: dict[str, Callable[[], object]] = {}
    errors: dict[str, str] = {}
    for mode in FUSED_MODES:
        if fused is not None:
            pair(
                f"MHLA fused (mhla_attention_fused), {mode}",
                lambda mode=mode: fused(
                    q, k, v, plan, mixing, cos=cos, sin=sin, normalize=mode, dot_dtype=_dot_dtype()
                ),
                mhla_inputs,
                grad_out,
            )
        pair(
            f"MHLA eager operator, {mode}",
            lambda mode=mode: mhla_attention(
                q, k, v, grid, sizes.layout, mixing, normalize=mode, plan=plan, feature_eps=1e-6, rotary=(cos, sin)
            ),
            mhla_inputs,
            grad_out,
        )
    pair(
        "plain linear attention (einsum)",
        lambda: plain_linear_attention(F.relu(q) + 1e-6, F.relu(k) + 1e-6, v),
        (q, k, v),
        grad_out,
    )
    heads_first = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    grad_heads_first = grad_out.transpose(1, 2).contiguous()
    fa3 = module_status(FA3_MODULE) == "imports"
    for kernel in SDPA_KERNELS[:3]:
        name = sdpa_method(kernel, fa3)
        status = probe_sdpa(kernel, heads_first[0].detach()[:, :, :256])
        if status != "ok":
            errors[name] = status
            continue
        pair(name, lambda kernel=kernel: run_sdpa(kernel, *heads_first), tuple(heads_first), grad_heads_first)
    tokens_first = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    if fa3:
        import flash_attn_interface

        pair(
            "FlashAttention-3 (flash_attn_interface)",
            lambda: flash_attn_interface.flash_attn_func(*tokens_first),
            tokens_first,
            grad_out,
        )
    if module_status(FA2_MODULE) == "imports":
        import flash_attn

        pair("FlashAttention-2 (flash_attn)", lambda: flash_attn.flash_attn_func(*tokens_first), tokens_first, grad_out)
    return calls, errors


def fused_backward_status() -> str:
    """Which backward the fused entry's autograd runs: the fused Triton backward's module, or the eager
    recompute of ``_FusedMHLA``."""
    status = module_status(FUSED_BACKWARD_MODULE)
    if status == "imports":
        return f"{FUSED_BACKWARD_MODULE} imports (the fused entry's autograd may use it: see the launched kernels)"
    return f"{FUSED_BACKWARD_MODULE} {status}: the fused entry's backward recomputes the forward eagerly"


def stage_training(ctx: StageContext) -> None:
    """Forward and forward + backward of the attention for fine-tuning, on each training grid; which
    kernels one fused forward + backward launches."""
    sizes, device, dtype = ctx.sizes, ctx.device, ctx.dtype
    plan = sizes.training_loops
    fused, fused_status = fused_kernel()
    ctx.data.update(
        rows=[],
        dtype=str(dtype).removeprefix("torch."),
        heads=sizes.heads,
        head_dim=sizes.head_dim,
        layout=_grid_label(sizes.layout),
        repeats=plan.repeats,
        timer=ctx.timer.name,
        fused=fused_status,
        fused_backward=fused_backward_status(),
        fa3=fa3_status(),
    )
    run_fused = ctx.fused_runs(fused, "the fused entry's forward + backward rows")
    for grid in sizes.training_grids:
        label = _grid_label(grid)
        calls, errors = training_calls(grid, sizes, device, dtype, fused if run_fused else None)
        timings, failed = time_loops(calls, ctx.timer, plan, ctx.log)
        methods = list(dict.fromkeys(name.split(" | ")[0] for name in calls)) + list(errors)
        for method in methods:
            forward, both = timings.get(f"{method} | forward"), timings.get(f"{method} | forward + backward")
            row: dict[str, Any] = {"grid": label, "tokens": math.prod(grid), "method": method}
            if forward and both:
                row.update(
                    calls=both.calls,
                    forward_ms=forward.per_call_s * 1e3,
                    forward_backward_ms=both.per_call_s * 1e3,
                    backward_ms=(both.per_call_s - forward.per_call_s) * 1e3,
                    backward_over_forward=(both.per_call_s - forward.per_call_s) / forward.per_call_s,
                    spread=max(forward.spread, both.spread),
                )
            else:
                why = (
                    errors.get(method)
                    or failed.get(f"{method} | forward + backward")
                    or failed.get(f"{method} | forward", "not timed")
                )
                row.update(forward_backward_ms=None, error=why)
            ctx.data["rows"].append(row)
        ctx.save()
        if run_fused and device.type == "cuda":
            name = next(m for m in methods if m.startswith("MHLA fused"))
            ctx.data.setdefault("fused_backward_kernels", {})[label] = kernel_counts(
                calls[f"{name} | forward + backward"], device
            )
            ctx.save()
        del calls


# ----------------------------------------------------------------------------- stage: profile


def profile_table(call: Callable[[], object], device: torch.device, rows: int = 15) -> str:
    """torch.profiler's table of one ``call`` (after three untimed ones), busiest ops first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with torch.no_grad():
        for _ in range(3):
            call()
        if cuda:
            torch.cuda.synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            call()
            if cuda:
                torch.cuda.synchronize(device)
    averages = prof.key_averages()
    for key in ["cuda_time_total", "device_time_total"] if cuda else ["cpu_time_total"]:
        try:
            return averages.table(sort_by=key, row_limit=rows)
        except Exception:  # the key's name changed between PyTorch versions
            continue
    return averages.table(row_limit=rows)


def stage_profile(ctx: StageContext) -> None:
    """The profiler's table of one Wan processor call (paper setting) on the first timing grid, and of the fused
    kernel."""
    sizes, grid = ctx.sizes, ctx.sizes.timing_grids[0]
    config = settings(sizes.layout)["paper"]
    _, call = wan_self_attention(
        grid, config, heads=sizes.heads, head_dim=sizes.head_dim, dtype=ctx.dtype, device=ctx.device
    )
    ctx.data["grid"] = "x".join(map(str, grid))
    ctx.data["tables"] = {"Wan processor path, paper": profile_table(call, ctx.device)}
    ctx.save()
    fused, status = fused_kernel()
    ctx.data["fused"] = status
    if ctx.fused_runs(fused, "the fused kernel's profile"):
        name, call = next(iter(_fused_calls(fused, grid, sizes, ctx.device, ctx.dtype).items()))
        ctx.data["tables"][name] = profile_table(call, ctx.device)


def stage_families(ctx: StageContext) -> None:
    """Each model family's self-attention at its published size (``mhla bench --families``): SDPA, global linear
    attention and MHLA (joint with the text block for HunyuanVideo, CogVideoX and Flux), bf16, one call each per
    round (smoke: 2 heads of 8 on tiny grids)."""
    from mhla_diffusion.benchmarks.families import FAMILY_MODELS, family_attention_table

    tiny = {"flux": (4, 6)}
    grids = {name: tiny.get(name, (2, 4, 4)) for name in FAMILY_MODELS} if ctx.smoke else None
    small = dict(heads=2, head_dim=8) if ctx.smoke else {}
    ctx.data["repeats"] = repeats = 1 if ctx.smoke else 3
    ctx.data["dtype"] = str(ctx.dtype).removeprefix("torch.")
    ctx.data["rows"] = []
    for name in FAMILY_MODELS:  # one family at a time, saved as it comes
        if ctx.left() < 5:
            ctx.data.setdefault("notes", []).append(f"stopped before {name}: the stage's time ran out")
            break
        rows = family_attention_table(
            [name], grids, dtype=ctx.dtype, device=ctx.device, repeats=repeats, warmup=1, **small
        )
        ctx.data["rows"] += rows
        ctx.save()


# ----------------------------------------------------------------------------- running the stages


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[StageContext], None]
    #: seconds of budget a stage needs to be started; later stages' needs are kept back from earlier stages
    needs_s: int
    #: the most seconds it may take (in its own process on CUDA: stopped there)
    limit_s: int


STAGES = (
    Stage("versions", stage_versions, 10, 45),
    Stage("correctness", stage_correctness, 20, 75),
    Stage("endtoend", stage_endtoend, 90, 240),
    Stage("gradients", stage_gradients, 15, 45),
    Stage("timing", stage_timing, 40, 100),
    Stage("training", stage_training, 30, 75),
    Stage("profile", stage_profile, 10, 30),
    Stage("families", stage_families, 5, 45),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def stage_limit(stage: Stage, left_s: float, later_needs_s: float) -> float | None:
    """Seconds ``stage`` may run with ``left_s`` of the budget left, keeping back what the later stages need to
    start; ``None`` when that is under the stage's own need (it is skipped)."""
    limit = min(stage.limit_s, left_s - later_needs_s)
    return limit if limit >= stage.needs_s else None


def kept_back(later: list[Stage], budget_s: float) -> float:
    """Seconds kept for the ``later`` stages: their needs, except those of stages that need more than the
    whole budget (they can never start, so nothing is kept for them)."""
    return float(sum(stage.needs_s for stage in later if stage.needs_s <= budget_s))


def plan_budget(budget_s: float, names: tuple[str, ...], stages: tuple[Stage, ...] | None = None) -> list[dict]:
    """The worst case of a session of ``names`` within ``budget_s``: every stage runs to its limit
    (:func:`stage_limit`, :func:`kept_back`). One entry per stage, in order: ``stage``, ``needs_s``,
    ``starts_after_s`` and ``limit_s`` (``None``: it could be skipped)."""
    chosen = [stage for stage in stages or STAGES if stage.name in names]
    used, plan = 0.0, []
    for i, stage in enumerate(chosen):
        limit = stage_limit(stage, budget_s - used, kept_back(chosen[i + 1 :], budget_s))
        plan.append({"stage": stage.name, "needs_s": stage.needs_s, "starts_after_s": used, "limit_s": limit})
        used += limit or 0.0
    return plan


#: Seconds before its limit at which a stage's own deadline falls (it skips optional parts past it).
DEADLINE_MARGIN_S = 10.0


def run_stage_here(out: Path, name: str, smoke: bool, deadline: float = math.inf) -> int:
    """Run stage ``name`` in this process, its entry saved as it goes; 0, or 1 when it raised."""
    session = load_session(out)
    stage = next(s for s in STAGES if s.name == name)
    device = torch.device("cpu" if smoke else "cuda")
    ctx = StageContext(out, session, name, SMOKE if smoke else FULL, device, smoke, deadline)
    session["stages"][name] = {"status": "running"}
    ctx.save()
    started = time.perf_counter()
    status = 0
    try:
        stage.run(ctx)
        ctx.data["status"] = "ok"
    except Exception as error:
        ctx.data.update(status="error", error=_error_line(error), traceback=traceback.format_exc()[-3000:])
        status = 1
    ctx.data["seconds"] = time.perf_counter() - started
    ctx.save()
    return status


def run_stage_isolated(out: Path, name: str, smoke: bool, limit_s: float) -> None:
    """Run stage ``name`` in a fresh process stopped after ``limit_s`` seconds (its own deadline falls
    :data:`DEADLINE_MARGIN_S` earlier); a killed or crashed stage keeps what it saved and is marked
    ``timeout`` / ``error``."""
    deadline = time.time() + limit_s - min(DEADLINE_MARGIN_S, 0.1 * limit_s)
    command = [sys.executable, str(Path(__file__).resolve()), str(out), "--stage", name, "--deadline", str(deadline)]
    command += ["--smoke"] if smoke else []
    started = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=limit_s, check=False)
        problem = None if done.returncode in (0, 1) else f"the stage's process ended with exit code {done.returncode}"
    except subprocess.TimeoutExpired:
        problem = f"stopped after {limit_s:.0f} s (its time limit in this session)"
    if problem:
        session = load_session(out)
        entry = session["stages"].setdefault(name, {})
        entry.update(
            status="timeout" if "stopped" in problem else "error", error=problem, seconds=time.perf_counter() - started
        )
        save_session(out, session)


def new_session(smoke: bool, budget_s: float, names: tuple[str, ...]) -> dict[str, Any]:
    sizes = SMOKE if smoke else FULL
    return {
        "format": FORMAT,
        "smoke": smoke,
        "device": "cpu" if smoke else "cuda",
        "torch": torch.__version__,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "requested": list(names),
        "plan": plan_budget(budget_s, names),
        "sizes": dataclasses.asdict(sizes),
        "stages": {},
    }


def run_session(out: Path, smoke: bool, budget_s: float, stages: tuple[str, ...], isolate: bool) -> dict[str, Any]:
    """Every stage in ``stages`` (in :data:`STAGES` order) within ``budget_s`` seconds; the session dict.

    Each stage gets :func:`stage_limit` of what is left (later requested stages' needs kept back); one that
    cannot get its need is recorded as skipped, saying why."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    chosen = [stage for stage in STAGES if stage.name in stages]
    session = new_session(smoke, budget_s, tuple(stage.name for stage in chosen))
    save_session(out, session)
    print(f"[gpu_session] plan within {budget_s:.0f} s: {session['plan']}", file=sys.stderr, flush=True)
    for i, stage in enumerate(chosen):
        left = budget_s - (time.monotonic() - started)
        later = kept_back(chosen[i + 1 :], budget_s)
        limit = stage_limit(stage, left, later)
        if limit is None:
            session = load_session(out)
            session["stages"][stage.name] = {
                "status": "skipped",
                "notes": [
                    f"skipped: {left:.0f} s of the session's {budget_s:.0f} s were left, {later:.0f} s of them "
                    f"kept for the later stages; the stage needs about {stage.needs_s} s"
                ],
            }
            save_session(out, session)
            continue
        print(f"[gpu_session] {stage.name}: up to {limit:.0f} s ({left:.0f} s left)", file=sys.stderr, flush=True)
        if isolate:
            run_stage_isolated(out, stage.name, smoke, limit)
        else:
            run_stage_here(out, stage.name, smoke, time.time() + limit)
    return load_session(out)


# ----------------------------------------------------------------------------- Markdown


TIMING_COLUMNS = (
    ("grid", "grid", ""),
    ("method", "method", ""),
    ("calls", "calls / loop", "d"),
    ("median_ms", "ms / call", ".3f"),
    ("spread", "spread", ".2f"),
    ("graph_ms", "graph ms / call", ".3f"),
    ("counted_units", "bytes (U)", ".1f"),
    ("bytes_basis", "bytes are", ""),
    ("gb_per_s", "GB/s", ".0f"),
    ("dram_units", "DRAM estimate (U)", ".1f"),
    ("dram_gb_per_s", "DRAM GB/s", ".0f"),
    ("floor_gb_per_s", "floor GB/s", ".0f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("error", "error", ""),
)
TRAINING_COLUMNS = (
    ("grid", "grid", ""),
    ("method", "method", ""),
    ("calls", "calls / loop", "d"),
    ("forward_ms", "forward ms", ".3f"),
    ("forward_backward_ms", "forward + backward ms", ".3f"),
    ("backward_ms", "backward ms", ".3f"),
    ("backward_over_forward", "backward / forward", ".2f"),
    ("spread", "spread", ".2f"),
    ("error", "error", ""),
)
CORRECTNESS_COLUMNS = (
    ("path", "path", ""),
    ("setting", "setting", ""),
    ("grid_kind", "grids", ""),
    ("checks", "checks", "d"),
    ("worst_rel_err", "worst ‖out − ref‖ / ‖ref‖", ".1e"),
    ("failed", "failed", "d"),
)
GRADIENT_COLUMNS = (
    ("tensor", "tensor", ""),
    ("eager", "eager bf16 error", ".1e"),
    ("fused", "fused bf16 error", ".1e"),
    ("fused_over_eager", "fused / eager", ".2f"),
    ("ok", "ok", ""),
)
ENDTOEND_COLUMNS = (
    ("method", "method", ""),
    ("attention", "self-attention", ""),
    ("median_s", "median s", ".3f"),
    ("spread", "spread", ".2f"),
    ("video_s", "100 forwards s", ".1f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("fused_launches", "fused launches", "d"),
    ("sdpa_over_mhla", "SDPA / MHLA", ".2f"),
    ("error", "error", ""),
)
COMPILE_COLUMNS = (
    ("setting", "model", ""),
    ("attention_path", "attention in the compiled graph", ""),
    ("graphs", "graphs", "d"),
    ("compile_s", "compile s", ".1f"),
    ("eager_s", "eager s", ".3f"),
    ("compiled_s", "compiled s", ".3f"),
    ("eager_over_compiled", "eager / compiled", ".2f"),
    ("rel_diff_vs_eager", "‖compiled − eager‖ / ‖eager‖", ".1e"),
    ("error", "error", ""),
)


def _status_line(session: dict[str, Any], name: str) -> list[str]:
    """What a reader must know beside a stage's numbers: not run (though asked for), cut, failed, notes."""
    entry = session.get("stages", {}).get(name)
    if entry is None:
        return [f"*{name}*: not run."] if name in session.get("requested", STAGE_NAMES) else []
    lines = []
    if entry.get("status") not in ("ok", None):
        reason = entry.get("error") or "; ".join(entry.get("notes", [])) or "no reason recorded"
        lines.append(f"*{name}*: {entry['status']} ({reason}).")
    lines += [f"*{name}*: {note}" for note in entry.get("notes", []) if entry.get("status") == "ok"]
    return lines


def _correctness_summary(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (path, setting): how many checks, the worst relative error, how many failed."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for check in checks:
        groups.setdefault((check["path"], check["setting"]), []).append(check)
    return [
        {
            "path": path,
            "setting": setting,
            "grid_kind": ", ".join(dict.fromkeys(c["grid_kind"] for c in rows)),
            "checks": len(rows),
            "worst_rel_err": max((c.get("rel_err", math.inf) for c in rows), default=None),
            "failed": sum(not c["ok"] for c in rows),
        }
        for (path, setting), rows in groups.items()
    ]


def _fa3_line(entry: dict[str, Any]) -> str:
    fa3 = entry.get("fa3") or {}
    return (
        f"FlashAttention-3 (`flash_attn_interface`): {fa3.get('flash_attn_interface', '?')}; {fa3.get('stand_in', '')}."
    )


def render_markdown(session: dict[str, Any]) -> str:
    """The "On a GPU" section of ``docs/speed.md`` from a session's JSON (whatever stages it holds)."""
    stages = session.get("stages", {})
    versions = stages.get("versions", {})
    v = versions.get("versions", {})
    gpu = versions.get("gpu") or {}
    where = gpu.get("name") or versions.get("cpu") or session.get("device", "?")
    head = (
        f"`benchmarks/gpu_session.sh` on {where}, {session.get('started', '?')[:10]}: "
        f"torch {v.get('torch', session.get('torch', '?'))}, "
        f"CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, Triton {v.get('triton')}, Diffusers {v.get('diffusers')}"
        + (f", commit {v['commit']}" if v.get("commit") else "")
        + "."
    )
    lines = (
        ["**Smoke run on the CPU at toy sizes: checks that the session runs, not measurements.**", ""]
        if session.get("smoke")
        else []
    )
    lines += [head, ""]
    lines += _status_line(session, "versions")
    if versions.get("sdpa_kernels"):
        lines.append(
            "SDPA kernels: "
            + ", ".join(
                f"{k} {'runs' if s == 'ok' else 'fails (' + s + ')'}" for k, s in versions["sdpa_kernels"].items()
            )
            + "."
        )
    if versions.get("fa3"):
        lines.append(_fa3_line(versions) + f" FlashAttention-2 (`flash_attn`): {versions.get('flash_attn')}.")
    if versions.get("mhla_paths"):
        lines.append("MHLA paths: " + "; ".join(f"{k}: {s}" for k, s in versions["mhla_paths"].items()) + ".")
    if versions.get("ceilings"):
        c = versions["ceilings"]
        lines.append(
            f"Measured ceilings: device copy {c['copy_gb_per_s']:.0f} GB/s, bf16 matmul "
            f"{c['bf16_matmul_tflop_per_s']:.0f} TFLOP/s."
        )
    lines.append("")

    correctness = stages.get("correctness", {})
    lines += _status_line(session, "correctness")
    if correctness.get("checks"):
        lines += [
            f"Correctness, bf16 on {session.get('device')} against float64 on the CPU (tolerance "
            f"{correctness.get('tolerance')}, autocast off and on; fused kernel: {correctness.get('fused')}): "
            f"{correctness.get('passed', '?')} checks pass, {correctness.get('failed', '?')} fail.",
            "",
            format_table(_correctness_summary(correctness["checks"]), CORRECTNESS_COLUMNS),
            "",
        ]
        lines += [
            f"- {c['path']} {c['setting']} {c['grid']}: {c['error']}" for c in correctness["checks"] if c.get("error")
        ]

    gradients = stages.get("gradients", {})
    lines += _status_line(session, "gradients")
    if gradients.get("rows"):
        lines += [
            f"Gradients before timing: at {gradients['grid']} tokens ({gradients['heads']} heads x "
            f"{gradients['head_dim']}, layout {gradients['layout']}), mixing {gradients['negative_share']:.0%} "
            f"negative, {gradients['dtype']} against a float32 eager reference on the device (largest error / largest "
            f"value); fused: {gradients['fused']}. A row passes when the fused error is within "
            f"{gradients['factor']}x the eager operator's: {len(gradients['rows']) - gradients['failed']} of "
            f"{len(gradients['rows'])} pass.",
            "",
            format_table(gradients["rows"], GRADIENT_COLUMNS),
            "",
        ]

    endtoend = stages.get("endtoend", {})
    lines += _status_line(session, "endtoend")
    if endtoend.get("rows"):
        lines += [
            f"Wan2.1-1.3B-shaped transformer, {endtoend['layers']} blocks, random weights, one eager forward at "
            f"{endtoend['grid']} tokens (MHLA layout {endtoend['layout']}) with {endtoend['text_tokens']} text "
            f"tokens, {endtoend['timer']}; MHLA's cross-attention on Diffusers' {endtoend['cross_attention']} "
            "backend; 100 forwards = 50 steps with guidance:",
            "",
            format_table(endtoend["rows"], ENDTOEND_COLUMNS),
            "",
        ]
    if endtoend.get("compiled"):
        lines += [
            f"The transformer compiled: `{endtoend['compile_call']}` (compile s: the first call):",
            "",
            format_table(endtoend["compiled"], COMPILE_COLUMNS),
            "",
        ]

    timing = stages.get("timing", {})
    lines += _status_line(session, "timing")
    if timing.get("rows"):
        floors = ", ".join(f"{g}: {u:.1f} U" for g, u in timing.get("floor_units", {}).items())
        lines += [
            f"Attention forwards, B=1, H={timing['heads']}, D={timing['head_dim']}, {timing['dtype']}, "
            f"layout {timing['layout']}; {timing['timer']}, per call = median loop / calls over "
            f"{timing['repeats']} rounds (spread: slowest / fastest loop); graph: the call replayed from a CUDA "
            f"graph; bytes counted on meta tensors in U = N x H x D x 2 bytes (floor of an MHLA call: {floors}); "
            "DRAM estimate (fused rows): the counted bytes less the RoPE angle plan and slot indices that every head "
            "reads again, which L2 serves after the first head; "
            f"fused kernel: {timing.get('fused')}. {_fa3_line(timing)}",
            "",
            format_table(timing["rows"], TIMING_COLUMNS),
            "",
        ]

    training = stages.get("training", {})
    lines += _status_line(session, "training")
    if training.get("rows"):
        lines += [
            f"Attention for fine-tuning, forward (grad on) and forward + backward, B=1, H={training['heads']}, "
            f"D={training['head_dim']}, {training['dtype']}, layout {training['layout']}; MHLA from raw q, k, v "
            f"with feature map, RoPE and mixing requiring grad; {training['timer']}, {training['repeats']} rounds. "
            f"Fused backward: {training.get('fused_backward')}. {_fa3_line(training)}",
            "",
            format_table(training["rows"], TRAINING_COLUMNS),
            "",
        ]
        for grid, kernels in training.get("fused_backward_kernels", {}).items():
            listed = ", ".join(f"{name} x{n}" for name, n in kernels.items())
            lines += [f"Kernels of one fused forward + backward at {grid}: {listed}.", ""]

    families = stages.get("families", {})
    lines += _status_line(session, "families")
    if families.get("rows"):
        from mhla_diffusion.benchmarks.families import FAMILY_COLUMNS

        lines += [
            f"Each family's self-attention at its published size (`mhla bench --families`), {families['dtype']}, "
            f"median of {families['repeats']} interleaved rounds, from the raw projections; SDPA over image + text "
            "tokens.",
            "",
            format_table(families["rows"], FAMILY_COLUMNS),
            "",
        ]

    profile = stages.get("profile", {})
    lines += _status_line(session, "profile")
    for name, table in profile.get("tables", {}).items():
        lines += [
            f"<details><summary>Profile of one call: {name}, {profile.get('grid')}</summary>",
            "",
            "```",
            table.rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
    return "\n".join(lines).strip()


def write_doc(page: Path, session: dict[str, Any]) -> None:
    """Replace the marked GPU section of the Markdown ``page`` by :func:`render_markdown` of ``session``."""
    page.write_text(replace_marked_section(page.read_text(), DOC_SECTION, render_markdown(session)))


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", nargs="?", type=Path, help="folder for gpu_session.json and gpu_session.md")
    p.add_argument(
        "--smoke", action="store_true", help="every stage at tiny sizes on the CPU (CUDA-only parts skipped)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for all stages (default {DEFAULT_BUDGET_S:.0f})",
    )
    p.add_argument("--stages", default=",".join(STAGE_NAMES), help=f"comma-separated subset of {','.join(STAGE_NAMES)}")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each stage in its own time-limited process (default: on CUDA, not with --smoke)",
    )
    p.add_argument(
        "--write-doc",
        type=Path,
        metavar="PAGE",
        help="replace the <!-- mhla-bench:cuda --> section of the Markdown page PAGE (docs/speed.md)",
    )
    p.add_argument("--report", type=Path, help="render a saved gpu_session.json (measures nothing)")
    p.add_argument("--stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)  # one stage, in an isolated process
    p.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)  # its time.time() deadline
    return p.parse_args(argv)


def _check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments as one line, or ``None``; nothing is written before this passes."""
    if args.report is None and args.out is None:
        return "give the output folder (OUT), or --report gpu_session.json"
    if args.report is not None and not args.report.is_file():
        return f"--report {args.report}: no such file; give the gpu_session.json a session wrote"
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        return f"output folder {args.out} is a file; give a folder (it is created when missing)"
    unknown = sorted(set(args.stages.split(",")) - set(STAGE_NAMES))
    if unknown:
        return f"--stages: unknown {','.join(unknown)}; choose from {','.join(STAGE_NAMES)}"
    if not args.budget_s > 0:
        return f"--budget-s {args.budget_s:g}: give a positive number of seconds"
    if args.write_doc is not None:
        if not args.write_doc.is_file():
            return f"--write-doc {args.write_doc}: no such file"
        try:
            replace_marked_section(args.write_doc.read_text(), DOC_SECTION, "")
        except ValueError as error:
            return f"--write-doc {args.write_doc}: {error}"
    if args.report is None and not args.smoke and not torch.cuda.is_available():
        return "no CUDA device here: run on a GPU, or with --smoke for the CPU check at tiny sizes"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage is not None:
        return run_stage_here(args.out, args.stage, args.smoke, args.deadline)
    problem = _check_args(args)
    if problem:
        print(f"gpu_session: {problem}", file=sys.stderr)
        return 2
    if args.report is not None:
        session = json.loads(args.report.read_text())
        if session.get("format") != FORMAT:
            print(
                f"gpu_session: --report {args.report} is not a GPU session result of this version "
                f"({FORMAT}); give the gpu_session.json this script wrote",
                file=sys.stderr,
            )
            return 2
    else:
        isolate = (not args.smoke) if args.isolate is None else args.isolate
        session = run_session(args.out, args.smoke, args.budget_s, tuple(args.stages.split(",")), isolate)
    if args.write_doc is not None:
        write_doc(args.write_doc, session)
    print(render_markdown(session))
    return 0


if __name__ == "__main__":
    sys.exit(main())
