"""The first GPU session of issue 34: what MHLA does on a lent GPU, measured in one call of at most 9 minutes.

Run it through ``benchmarks/gpu_session.sh`` (how to call it with the device tool is written at its top);
``python benchmarks/gpu_session.py OUT [--smoke]`` works too where this tree's packages are importable.

Stages, in the order they run (each writes its entry of ``OUT/gpu_session.json`` as soon as it has
something, and ``OUT/gpu_session.md`` is rendered again after every stage, so a run cut short keeps what it
measured):

``versions``     torch, CUDA, cuDNN, Triton, Diffusers, the GPU; which SDPA kernels run (flash, cuDNN,
                 memory-efficient, math, each tried alone); the copy bandwidth and bf16 matmul rate (CUDA).
``correctness``  bf16 on the device against float64 on the CPU, on even, uneven and empty-block grids, paper
                 and released settings, autocast off and on: the operator against the O(N^2) reference, the
                 Wan processor's whole path (feature map, RoPE, norm, gate) against itself in float64, and
                 the fused Triton kernel (CUDA, when it imports) against the reference.
``timing``       the operator at 21x30x50 and 21x30x52 (B=1, H=12, D=128, bf16): plan per call and
                 precomputed, with RoPE, the processor's path in both settings, a plain einsum linear
                 attention, SDPA's flash / cuDNN / memory-efficient kernels, TF32 off and on, the fused
                 kernel; device time by CUDA events, and GB/s against the bytes counted on meta tensors.
``profile``      torch.profiler's top ops of one processor call (and one fused call).
``transformer``  a 30-block Wan2.1-1.3B-shaped transformer with random weights built on the GPU, at 21x30x52
                 tokens (latent 21x60x104, 512 text tokens): stock per SDPA backend, MHLA paper and released;
                 time of one forward, peak memory, 100 forwards (50 steps with guidance) extrapolated.
``compile``      ``torch.compile`` (Inductor) of the processor's path: compile time, time after warm-up.

Then the Markdown (:func:`render_markdown`) goes into ``docs/speed.md`` between ``<!-- mhla-bench:cuda -->`` and
``<!-- /mhla-bench:cuda -->`` with ``--write-doc docs/speed.md`` (also from a saved JSON: ``--report``).

``--smoke`` runs every stage at tiny sizes on the CPU, in one process (the test suite does, in
``tests/bench/test_gpu_session.py``); parts that need CUDA are skipped with a note saying so. On CUDA each
stage runs in its own process under a time limit (``--isolate``, the default there): a kernel fault or a
hung compile costs one stage, not the session.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import mhla_diffusion from this tree
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mhla_diffusion.benchmarks.bench import (  # noqa: E402
    TRANSFORMER_COLUMNS,
    format_table,
    plain_linear_attention,
    replace_marked_section,
    rotary_tables,
    time_calls,
    traffic_settings,
    wan_self_attention,
    wan_transformer_table,
)

FORMAT = "mhla-gpu-session/1"
JSON_NAME, MARKDOWN_NAME = "gpu_session.json", "gpu_session.md"
DOC_SECTION = "cuda"
#: Relative error ‖out − ref‖ / ‖ref‖ a bf16 result may have (bf16 operands land between 1e-3 and 1e-2).
BF16_TOLERANCE = 1e-2
SDPA_KERNELS = ("flash", "cudnn", "efficient", "math")


@dataclass(frozen=True)
class Sizes:
    """Every size a session uses: :data:`FULL` on a GPU, :data:`SMOKE` on a CPU."""

    heads: int
    head_dim: int
    layout: tuple[int, int, int]
    correctness_grids: dict[str, tuple[int, int, int]]
    timing_grids: tuple[tuple[int, int, int], ...]
    repeats: int
    warmup: int
    transformer_grid: tuple[int, int, int]
    transformer_layout: tuple[int, int, int]
    transformer_layers: int
    transformer_dim: int
    transformer_heads: int
    transformer_ffn: int
    text_tokens: int
    transformer_repeats: int
    compile_backend: str


FULL = Sizes(
    heads=12,
    head_dim=128,
    layout=(3, 5, 10),
    correctness_grids={"even": (6, 10, 20), "uneven": (5, 7, 13), "empty blocks": (2, 4, 9)},
    timing_grids=((21, 30, 50), (21, 30, 52)),
    repeats=20,
    warmup=3,
    transformer_grid=(21, 30, 52),
    transformer_layout=(3, 5, 10),
    transformer_layers=30,
    transformer_dim=1536,
    transformer_heads=12,
    transformer_ffn=8960,
    text_tokens=512,
    transformer_repeats=3,
    compile_backend="inductor",
)
SMOKE = Sizes(
    heads=2,
    head_dim=16,
    layout=(3, 5, 10),
    correctness_grids={"even": (6, 5, 10), "uneven": (4, 7, 12), "empty blocks": (2, 4, 9)},
    timing_grids=((3, 5, 10), (3, 5, 12)),
    repeats=2,
    warmup=1,
    transformer_grid=(2, 4, 4),
    transformer_layout=(1, 2, 2),
    transformer_layers=2,
    transformer_dim=32,
    transformer_heads=2,
    transformer_ffn=64,
    text_tokens=4,
    transformer_repeats=1,
    compile_backend="aot_eager",  # Inductor's C++ build takes minutes on a small CPU
)


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
    """What a stage function gets: sizes, device, the stage's own JSON entry (``data``) and ``save()``."""

    out: Path
    session: dict[str, Any]
    name: str
    sizes: Sizes
    device: torch.device
    smoke: bool

    @property
    def data(self) -> dict[str, Any]:
        return self.session["stages"][self.name]

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def note(self, line: str) -> None:
        """A line for the reader (something skipped, and why)."""
        self.data.setdefault("notes", []).append(line)
        self.save()

    def save(self) -> None:
        save_session(self.out, self.session)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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


# ----------------------------------------------------------------------------- stage 1: versions


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


def _median_event_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    return time_calls({"fn": fn}, repeats, 2, device)["fn"][0]


def stage_versions(ctx: StageContext) -> None:
    """Versions, the device, SDPA kernels that run, and (CUDA) the copy and matmul ceilings."""
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
    ctx.save()
    if ctx.cuda_only("copy bandwidth and bf16 matmul ceilings"):
        ctx.data["ceilings"] = measure_ceilings(ctx.device)


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """A 2 GiB device-to-device copy (bytes read + written per second) and an 8192^3 bf16 matmul on random data."""
    src = torch.randn(2**30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = _median_event_seconds(lambda: dst.copy_(src), device)
    src = dst = None  # 4 GiB freed before the matmul's operands
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_s = _median_event_seconds(lambda: a @ b, device)
    return {"copy_gb_per_s": 2 * 2**31 / copy_s / 1e9, "bf16_matmul_tflop_per_s": 2 * 8192**3 / matmul_s / 1e12}


# ----------------------------------------------------------------------------- stage 2: correctness


def settings(layout: tuple[int, ...]) -> dict[str, Any]:
    """The paper and released settings (:func:`~mhla_diffusion.benchmarks.bench.traffic_settings`) on ``layout``."""
    return {name: dataclasses.replace(config, layout=layout) for name, config in traffic_settings().items()}


def fused_kernel() -> tuple[Callable | None, str]:
    """The fused Triton forward and ``"available"``, or ``None`` and why not."""
    try:
        from mhla_diffusion.ops.triton_mhla import mhla_attention_fused
    except Exception as error:
        return None, f"not available: {_error_line(error)}"
    return mhla_attention_fused, "available"


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
        cos, sin = rotary_tables(n, sizes.head_dim, "cpu", g)
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


# ----------------------------------------------------------------------------- stage 3: operator timing


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
        cos, sin = rotary_tables(n, sizes.head_dim, device, g)
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
    from mhla_diffusion.benchmarks.bench import count_path

    calls = operator_calls(grid, sizes, "meta", dtype)
    return {name: sum(size for _, size in count_path(call, fused)[0].values()) for name, call in calls.items()}


def fused_bytes(grid: tuple[int, ...], sizes: Sizes, dtype: torch.dtype, normalize: str) -> int:
    """Bytes of one call of :func:`_fused_calls`'s kernel, counted from its launch."""
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.triton_mhla import fused_traffic

    plan = block_plan(grid, sizes.layout)
    return sum(
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
        ).values()
    )


def stage_timing(ctx: StageContext) -> None:
    """Device time of every attention on each timing grid, and GB/s against the counted bytes."""
    from mhla_diffusion.ops.traffic import floor_bytes

    sizes, device, dtype = ctx.sizes, ctx.device, ctx.dtype
    ctx.data.update(
        rows=[],
        dtype=str(dtype).removeprefix("torch."),
        heads=sizes.heads,
        head_dim=sizes.head_dim,
        layout="x".join(map(str, sizes.layout)),
        repeats=sizes.repeats,
        timer="CUDA events" if device.type == "cuda" else "wall clock",
    )
    fused, ctx.data["fused"] = fused_kernel()
    tf32 = ctx.cuda_only("the TF32 rows")
    run_fused = ctx.fused_runs(fused, "the fused Triton kernel's rows")
    unit_of = lambda n: n * sizes.heads * sizes.head_dim * torch.empty((), dtype=dtype).element_size()  # noqa: E731
    for grid in sizes.timing_grids:
        n, label = math.prod(grid), "x".join(map(str, grid))
        unit = unit_of(n)
        floor = floor_bytes(1, n, sizes.heads, sizes.head_dim, sizes.head_dim, math.prod(sizes.layout), dtype)
        bytes_of = counted_bytes(grid, sizes, dtype, fused=run_fused)
        plain = operator_calls(grid, sizes, device, dtype)
        calls = {name: _at_precision(call, False) for name, call in plain.items()}
        basis = dict.fromkeys(calls, "counted")
        if tf32:
            for name in [c for c in plain if c.startswith(TF32_ROWS)]:
                calls[f"{name}, TF32"] = _at_precision(plain[name], True)
                bytes_of[f"{name}, TF32"], basis[f"{name}, TF32"] = bytes_of[name], "counted"
        errors: dict[str, str] = {}
        g = torch.Generator().manual_seed(1)
        heads_first = [torch.randn(1, sizes.heads, n, sizes.head_dim, generator=g).to(device, dtype) for _ in range(3)]
        for kernel in SDPA_KERNELS[:3]:
            name = f"SDPA {kernel}"
            status = probe_sdpa(kernel, heads_first[0][:, :, :256])
            if status != "ok":
                errors[name] = status
                continue
            calls[name] = lambda kernel=kernel, inputs=heads_first: run_sdpa(kernel, *inputs)
            bytes_of[name], basis[name] = 4 * unit, "q, k, v, out once"
        if run_fused:
            fused_calls = _fused_calls(fused, grid, sizes, device, dtype)
            for mode in FUSED_MODES:
                bytes_of[_fused_name(mode)] = fused_bytes(grid, sizes, dtype, mode)
                basis[_fused_name(mode)] = "counted from the launch"
        timings = time_calls(calls, sizes.repeats, sizes.warmup, device)
        if run_fused:  # after the others: a fault in the new kernel loses only its own rows
            for name, call in fused_calls.items():
                try:
                    timings.update(time_calls({name: call}, sizes.repeats, sizes.warmup, device))
                except Exception as error:
                    errors[name] = _error_line(error)
        torch.set_float32_matmul_precision("highest")
        for name, (seconds, peak) in timings.items():
            ctx.data["rows"].append(
                {
                    "grid": label,
                    "tokens": n,
                    "method": name,
                    "median_ms": seconds * 1e3,
                    "counted_units": bytes_of[name] / unit,
                    "bytes_basis": basis[name],
                    "gb_per_s": bytes_of[name] / seconds / 1e9,
                    "floor_gb_per_s": floor / seconds / 1e9 if name.startswith(MHLA_ROWS) else None,
                    "peak_extra_mb": peak / 2**20,
                }
            )
        for name, error in errors.items():
            ctx.data["rows"].append({"grid": label, "tokens": n, "method": name, "median_ms": None, "error": error})
        ctx.data.setdefault("floor_units", {})[label] = floor / unit
        ctx.save()
        del plain, calls, heads_first


def _fused_calls(
    fused: Callable, grid: tuple[int, ...], sizes: Sizes, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable]:
    """The fused kernel from projected ``q, k`` (feature map and RoPE inside), both normalisations."""
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.mixing import mixing_init

    n = math.prod(grid)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, sizes.heads, sizes.head_dim, generator=g).to(device, dtype) for _ in range(3))
    cos, sin = rotary_tables(n, sizes.head_dim, device, g)
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


# ----------------------------------------------------------------------------- stage 4: profile


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


# ----------------------------------------------------------------------------- stage 5: torch.compile


def stage_compile(ctx: StageContext) -> None:
    """``torch.compile`` of the Wan processor's path, both settings: compile time, time after warm-up, error."""
    sizes, grid = ctx.sizes, ctx.sizes.timing_grids[0]
    backend = sizes.compile_backend
    ctx.data.update(backend=backend, grid="x".join(map(str, grid)), rows=[])
    if backend != "inductor":
        ctx.note(
            f"backend {backend} instead of Inductor in smoke mode: Inductor's C++ build takes minutes on a small CPU"
        )
    for setting, config in settings(sizes.layout).items():
        _, call = wan_self_attention(
            grid, config, heads=sizes.heads, head_dim=sizes.head_dim, dtype=ctx.dtype, device=ctx.device
        )
        row: dict[str, Any] = {"setting": setting}
        try:
            torch._dynamo.reset()
            compiled = torch.compile(call, backend=backend)
            started = time.perf_counter()
            with torch.no_grad():
                out = compiled()
            ctx.sync()
            row["compile_s"] = time.perf_counter() - started
            with torch.no_grad():
                expected = call()
            row["max_abs_diff_vs_eager"] = float((out.float() - expected.float()).abs().max())
            timings = time_calls({"eager": call, "compiled": compiled}, sizes.repeats, sizes.warmup, ctx.device)
            row.update(
                eager_ms=timings["eager"][0] * 1e3,
                compiled_ms=timings["compiled"][0] * 1e3,
                eager_over_compiled=timings["eager"][0] / timings["compiled"][0],
            )
        except Exception as error:
            row["error"] = _error_line(error)
        ctx.data["rows"].append(row)
        ctx.save()


# ----------------------------------------------------------------------------- stage 6: Wan transformer


def stage_transformer(ctx: StageContext) -> None:
    """A Wan2.1-1.3B-shaped transformer with random weights: stock per SDPA backend vs MHLA paper / released."""
    if _package_version("diffusers") is None:
        ctx.note("Diffusers is not installed here (see benchmarks/gpu_session.sh on carrying its wheel): skipped")
        return
    sizes = ctx.sizes
    ctx.data.update(
        grid="x".join(map(str, sizes.transformer_grid)),
        layers=sizes.transformer_layers,
        text_tokens=sizes.text_tokens,
        dim=sizes.transformer_dim,
        forwards_per_video=100,
    )
    rows = wan_transformer_table(
        sizes.transformer_grid,
        sizes.transformer_layout,
        sizes.transformer_layers,
        sizes.transformer_dim,
        sizes.transformer_heads,
        sizes.transformer_ffn,
        sizes.text_tokens,
        ctx.dtype,
        ctx.device,
        sizes.transformer_repeats,
        1,
        log=lambda text: print(text, file=sys.stderr, flush=True),
        settings={f"mhla {name}": config for name, config in settings(sizes.transformer_layout).items()},
    )
    for row in rows:
        row["video_s"] = 100 * row["median_s"]  # 50 steps, each a conditional and an unconditional forward
    ctx.data["rows"] = rows


# ----------------------------------------------------------------------------- running the stages


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[StageContext], None]
    #: seconds of budget a stage needs to be started; at most this long in its own process (isolated runs)
    needs_s: int
    limit_s: int


STAGES = (
    Stage("versions", stage_versions, 15, 60),
    Stage("correctness", stage_correctness, 30, 120),
    Stage("timing", stage_timing, 30, 120),
    Stage("profile", stage_profile, 15, 60),
    Stage("transformer", stage_transformer, 60, 180),
    Stage("compile", stage_compile, 45, 180),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def run_stage_here(out: Path, name: str, smoke: bool) -> int:
    """Run stage ``name`` in this process, its entry saved as it goes; 0, or 1 when it raised."""
    session = load_session(out)
    stage = next(s for s in STAGES if s.name == name)
    device = torch.device("cpu" if smoke else "cuda")
    ctx = StageContext(out, session, name, SMOKE if smoke else FULL, device, smoke)
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
    """Run stage ``name`` in a fresh process limited to ``limit_s`` seconds; a killed or crashed stage keeps
    what it saved and is marked ``timeout`` / ``error``."""
    command = [sys.executable, str(Path(__file__).resolve()), str(out), "--stage", name] + (
        ["--smoke"] if smoke else []
    )
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


def new_session(smoke: bool, budget_s: float) -> dict[str, Any]:
    sizes = SMOKE if smoke else FULL
    return {
        "format": FORMAT,
        "smoke": smoke,
        "device": "cpu" if smoke else "cuda",
        "torch": torch.__version__,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "sizes": dataclasses.asdict(sizes),
        "stages": {},
    }


def run_session(out: Path, smoke: bool, budget_s: float, stages: tuple[str, ...], isolate: bool) -> dict[str, Any]:
    """Every stage in ``stages`` (in :data:`STAGES` order) within ``budget_s`` seconds; the session dict."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    session = new_session(smoke, budget_s)
    session["requested"] = [stage.name for stage in STAGES if stage.name in stages]
    save_session(out, session)
    for stage in STAGES:
        if stage.name not in stages:
            continue
        left = budget_s - (time.monotonic() - started)
        if left < stage.needs_s:
            session = load_session(out)
            session["stages"][stage.name] = {
                "status": "skipped",
                "notes": [
                    f"skipped: {left:.0f} s of the session's {budget_s:.0f} s were left, "
                    f"the stage needs about {stage.needs_s} s"
                ],
            }
            save_session(out, session)
            continue
        print(f"[gpu_session] {stage.name} ({left:.0f} s left)", file=sys.stderr, flush=True)
        if isolate:
            run_stage_isolated(out, stage.name, smoke, min(stage.limit_s, left))
        else:
            run_stage_here(out, stage.name, smoke)
    return load_session(out)


# ----------------------------------------------------------------------------- Markdown


TIMING_COLUMNS = (
    ("grid", "grid", ""),
    ("method", "method", ""),
    ("median_ms", "median ms", ".2f"),
    ("counted_units", "bytes (U)", ".1f"),
    ("bytes_basis", "bytes are", ""),
    ("gb_per_s", "GB/s", ".0f"),
    ("floor_gb_per_s", "floor GB/s", ".0f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
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
COMPILE_COLUMNS = (
    ("setting", "setting", ""),
    ("compile_s", "compile s", ".1f"),
    ("eager_ms", "eager ms", ".2f"),
    ("compiled_ms", "compiled ms", ".2f"),
    ("eager_over_compiled", "eager / compiled", ".2f"),
    ("max_abs_diff_vs_eager", "max abs diff", ".1e"),
    ("error", "error", ""),
)
VIDEO_COLUMNS = TRANSFORMER_COLUMNS + (("video_s", "100 forwards s", ".1f"), ("weights_mb", "weights MiB", ".0f"))


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
        f"CUDA {v.get('cuda')}, Triton {v.get('triton')}, Diffusers {v.get('diffusers')}"
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

    timing = stages.get("timing", {})
    lines += _status_line(session, "timing")
    if timing.get("rows"):
        floors = ", ".join(f"{g}: {u:.1f} U" for g, u in timing.get("floor_units", {}).items())
        lines += [
            f"Attention operators, B=1, H={timing['heads']}, D={timing['head_dim']}, {timing['dtype']}, "
            f"layout {timing['layout']}, median of {timing['repeats']} ({timing['timer']}); "
            f"bytes counted on meta tensors in U = N x H x D x 2 bytes (floor of an MHLA call: {floors}); "
            f"fused kernel: {timing.get('fused')}:",
            "",
            format_table(timing["rows"], TIMING_COLUMNS),
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

    transformer = stages.get("transformer", {})
    lines += _status_line(session, "transformer")
    if transformer.get("rows"):
        lines += [
            f"Wan2.1-1.3B-shaped transformer, {transformer['layers']} blocks, random weights, one forward at "
            f"{transformer['grid']} tokens with {transformer['text_tokens']} text tokens; 100 forwards = 50 "
            "steps with guidance (extrapolated):",
            "",
            format_table(transformer["rows"], VIDEO_COLUMNS),
            "",
        ]

    compiled = stages.get("compile", {})
    lines += _status_line(session, "compile")
    if compiled.get("rows"):
        lines += [
            f"`torch.compile` ({compiled['backend']}) of the Wan processor's path at {compiled['grid']}:",
            "",
            format_table(compiled["rows"], COMPILE_COLUMNS),
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
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for all stages (default 480)")
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
        return run_stage_here(args.out, args.stage, args.smoke)
    problem = _check_args(args)
    if problem:
        print(f"gpu_session: {problem}", file=sys.stderr)
        return 2
    if args.report is not None:
        session = json.loads(args.report.read_text())
        if session.get("format") != FORMAT:
            print(
                f"gpu_session: --report {args.report} is not a GPU session result; give gpu_session.json",
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
