"""The ``correctness`` and ``gradients`` stages: bf16 on the device against float64 / float32 references."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mhla_diffusion.benchmarks.attention_traffic import (
    wan_rotary_tables,
    wan_self_attention,
)

from . import environment
from .common import BF16_TOLERANCE, StageContext, _dot_dtype, _error_line, _grid_label
from .environment import settings


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
    fused, fused_status = environment.fused_kernel()
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
    fused, status = environment.fused_kernel()
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
