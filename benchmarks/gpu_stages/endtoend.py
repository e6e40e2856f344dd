"""The ``endtoend`` stage: a Wan2.1-1.3B-shaped transformer eager and compiled, and which attention path its
compiled graph holds (:class:`GraphRecorder`)."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import time
import traceback
from typing import Any, Callable, Iterator

import torch

from .calls import fused_launches, kernel_counts
from .common import Sizes, StageContext, _error_line, _grid_label, time_loops
from .environment import _package_version, settings


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
