"""The ``training`` stage: forward and backward of the attention paths."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mhla_diffusion.benchmarks.attention_traffic import (
    wan_rotary_tables,
)
from mhla_diffusion.benchmarks.bench import plain_linear_attention

from . import environment
from .calls import FUSED_MODES, kernel_counts, loop_stage_entry
from .common import (
    FA2_MODULE,
    FA3_MODULE,
    FUSED_BACKWARD_MODULE,
    SDPA_KERNELS,
    Sizes,
    StageContext,
    _dot_dtype,
    _grid_label,
    time_loops,
)
from .environment import module_status, probe_sdpa, run_sdpa, sdpa_method


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
    fused, fused_status = environment.fused_kernel()
    ctx.data.update(loop_stage_entry(ctx, plan, fused=fused_status, fused_backward=fused_backward_status()))
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
