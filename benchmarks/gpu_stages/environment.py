"""What runs here: versions, which SDPA kernels and FlashAttention builds work, which MHLA paths exist (the fused
entry among them), the MHLA settings timed; the ``versions`` stage."""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
import subprocess
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mhla_diffusion.benchmarks.attention_traffic import (
    traffic_settings,
)

from .common import (
    FA2_MODULE,
    FA3_MODULE,
    FUSED_BACKWARD_MODULE,
    FUSED_OP_MODULE,
    ROOT,
    SDPA_KERNELS,
    CudaEventTimer,
    LoopPlan,
    Sizes,
    StageContext,
    _error_line,
    time_loops,
)


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
