"""What each process of the context-parallel tests runs (tests/parallel/).

The functions here run inside the gloo processes started by
:func:`mhla_diffusion.models.context_parallel.run_cpu_processes` (so they live in an importable module, not
in a test file). Every process computes the one-process result itself, on the whole sequence with
the same seeds, then its own share with the sequence split across the group, and returns the largest
differences; the tests assert on them. Gradients of parameters are summed over the group first
(each process holds the part from its own tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from mhla_diffusion.ops.attention import mhla_attention
from mhla_diffusion.ops.context_parallel import (
    TokenShard,
    grid_conv_context_parallel,
    mhla_attention_context_parallel,
)

#: Operator cases: grids whose blocks straddle the ranks' ranges, token counts that 2 or 3 do not
#: divide (tensor_split rule), uneven and empty blocks, every normalisation, RoPE'd numerators, per-head mixing.
OPERATOR_CASES: dict[str, dict[str, Any]] = {
    "uneven blocks, denominator, rope": dict(grid=(5, 5, 7), layout=(2, 3, 2), normalize="denominator", rope=True),
    "no denominator, per-head mixing": dict(
        grid=(5, 5, 7), layout=(3, 2, 2), normalize="none", rope=True, per_head=True
    ),
    "scalar-mixed denominator": dict(grid=(5, 3, 3), layout=(5, 1, 3), normalize="scalar_mixed_denominator"),
    "empty blocks": dict(grid=(1, 6, 7), layout=(2, 2, 3), normalize="denominator", rope=True),
    "image grid": dict(grid=(7, 9), layout=(3, 3), normalize="denominator"),
}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest absolute difference, largest absolute one-process value)."""
    return max_diff(got, want), float(want.detach().abs().max())


def _summed(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def operator_case(
    grid: tuple[int, ...],
    layout: tuple[int, ...],
    normalize: str,
    rope: bool = False,
    per_head: bool = False,
    batch: int = 2,
    heads: int = 3,
    dim: int = 4,
    dim_v: int = 5,
) -> dict[str, tuple[float, float]]:
    """Forward and gradients of the context-parallel operator against :func:`mhla_attention` on the whole grid."""
    n, m = math.prod(grid), math.prod(layout)
    g = torch.Generator().manual_seed(7)
    full = dict(
        q=torch.rand(batch, n, heads, dim, generator=g, dtype=torch.float64).float() + 0.05,
        k=torch.rand(batch, n, heads, dim, generator=g, dtype=torch.float64).float() + 0.05,
        v=torch.randn(batch, n, heads, dim_v, generator=g),
    )
    if rope:
        full["q_rot"] = torch.randn(batch, n, heads, dim, generator=g)
        full["k_rot"] = torch.randn(batch, n, heads, dim, generator=g)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, generator=g)
    weights = torch.randn(batch, n, heads, dim_v, generator=g)  # the loss's weights: loss = Σ out * weights

    ref = {name: t.clone().requires_grad_() for name, t in full.items()}
    ref_mixing = mixing.clone().requires_grad_()
    ref_out = mhla_attention(
        ref["q"],
        ref["k"],
        ref["v"],
        grid,
        layout,
        ref_mixing,
        q_rot=ref.get("q_rot"),
        k_rot=ref.get("k_rot"),
        normalize=normalize,
    )
    (ref_out * weights).sum().backward()

    shard = TokenShard.split(n, even=False)
    own = slice(shard.start, shard.stop)
    local = {name: t[:, own].clone().requires_grad_() for name, t in full.items()}
    local_mixing = mixing.clone().requires_grad_()
    out = mhla_attention_context_parallel(
        local["q"],
        local["k"],
        local["v"],
        grid,
        layout,
        local_mixing,
        shard,
        q_rot=local.get("q_rot"),
        k_rot=local.get("k_rot"),
        normalize=normalize,
    )
    (out * weights[:, own]).sum().backward()

    diffs = {"output": _compare(out, ref_out[:, own])}
    for name in full:
        if ref[name].grad is None:  # unused input (q, k without a denominator when RoPE'd ones are given)
            diffs[f"grad {name}"] = (0.0 if local[name].grad is None else float("inf"), 0.0)
        else:
            diffs[f"grad {name}"] = _compare(local[name].grad, ref[name].grad[:, own])
    diffs["grad mixing"] = _compare(_summed(local_mixing.grad), ref_mixing.grad)
    return diffs


def lepe_case(grid: tuple[int, ...], channels: int = 6, batch: int = 2) -> dict[str, tuple[float, float]]:
    """The halo-exchanging grid convolution against the convolution of the whole grid."""
    n = math.prod(grid)
    torch.manual_seed(3)
    conv = (torch.nn.Conv3d if len(grid) == 3 else torch.nn.Conv2d)(channels, channels, 3, padding=1, groups=channels)
    x = torch.randn(batch, n, channels, generator=torch.Generator().manual_seed(4))
    weights = torch.randn(batch, n, channels, generator=torch.Generator().manual_seed(5))

    x_ref = x.clone().requires_grad_()
    ref = conv(x_ref.transpose(1, 2).reshape(batch, channels, *grid)).reshape(batch, channels, n).transpose(1, 2)
    (ref * weights).sum().backward()
    ref_weight_grad = conv.weight.grad.clone()
    conv.zero_grad()

    shard = TokenShard.split(n, even=False)
    own = slice(shard.start, shard.stop)
    x_local = x[:, own].clone().requires_grad_()
    out = grid_conv_context_parallel(conv, x_local, grid, shard)
    (out * weights[:, own]).sum().backward()
    return {
        "output": _compare(out, ref[:, own]),
        "grad x": _compare(x_local.grad, x_ref.grad[:, own]),
        "grad weight": _compare(_summed(conv.weight.grad), ref_weight_grad),
    }


#: Grids for the LePE halo exchange: with 3 ranks the middle range is shorter than the halo (its
#: window reaches both neighbours, and past them), and single-frame / image grids.
LEPE_GRIDS = {"video": (5, 3, 4), "short ranges": (2, 3, 4), "image": (7, 9)}


def operator_suite() -> dict[str, dict[str, tuple[float, float]]]:
    """Every operator and LePE case on this process group."""
    results = {f"operator: {name}": operator_case(**case) for name, case in OPERATOR_CASES.items()}
    results.update({f"lepe: {name}": lepe_case(grid) for name, grid in LEPE_GRIDS.items()})
    return results


# ----------------------------------------------------------------------------- whole transformers

#: Tiny Wan cases: MHLA options, the split ("even": Diffusers' default, N % P == 0; "uneven":
#: ``ulysses_anything``, N % P != 0) and whether to compare training gradients. The grid comes from
#: :func:`case_grid`. Layouts put blocks across the ranks' ranges (layout (1, 2, 3): every block spans
#: every frame). Diffusers 0.42 has no backward for Ulysses-anything attention, so the uneven hybrid
#: case compares the forward only.
TRANSFORMER_CASES: dict[str, dict[str, Any]] = {
    "released Wan extras + LePE, uneven split, gradients": dict(
        mhla=dict(layout=(2, 2, 2), normalization="none", output_norm=True, gate=True, lepe=True),
        split="uneven",
        grads=True,
    ),
    "denominator + gate + LePE, even split, gradients": dict(
        mhla=dict(layout=(1, 2, 3), normalization="denominator", gate=True, lepe=True), split="even", grads=True
    ),
    "hybrid with Ulysses softmax layers, even split, gradients": dict(
        mhla=dict(layers="hybrid", layout=(1, 2, 3), normalization="none", output_norm=True), split="even", grads=True
    ),
    "hybrid with Ulysses-anything softmax layers, uneven split": dict(
        mhla=dict(layers="hybrid", layout=(2, 2, 2), normalization="denominator", lepe=True),
        split="uneven",
        grads=False,
    ),
}


def case_grid(split: str, world_size: int) -> tuple[int, int, int]:
    """A token grid that ``world_size`` (2 or 3) divides (``"even"``) or does not (``"uneven"``):
    (2, 5, 7) has 70 tokens, (3, 5, 7) 105."""
    grids = [(2, 5, 7), (3, 5, 7)]
    even = next(g for g in grids if math.prod(g) % world_size == 0)
    uneven = next(g for g in grids if math.prod(g) % world_size)
    return even if split == "even" else uneven


def _randomise_mhla(model: torch.nn.Module) -> None:
    """Move the MHLA extras off their identity-like init, so that a wrong LePE / gate / norm shows."""
    from mhla_diffusion.models.conversion import mhla_parameter_names

    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name in mhla_parameter_names(model):
            params[name].add_(0.1 * torch.randn(params[name].shape, generator=g))


def transformer_case(mhla: dict[str, Any], split: str, grads: bool) -> dict[str, Any]:
    """The tiny Wan transformer (3 blocks, as many heads as processes, for Ulysses) on the whole grid vs.
    split across this process group.

    Returns the grid's token count, the parameters that got a gradient in one run but not the other, and
    ``compared``: ``{quantity: (max abs difference, max abs one-process value)}`` for the output and,
    with ``grads``, every parameter's gradient (summed over the group) of ``Σ output * weights``.
    """
    from helpers.models import wan_inputs
    from mhla_diffusion.config import MHLAConfig
    from mhla_diffusion.models.context_parallel import (
        context_parallel_config,
        disable_context_parallel,
        enable_context_parallel,
    )
    from mhla_diffusion.models.conversion import convert_to_mhla
    from mhla_diffusion.models.tiny import tiny_wan_transformer

    world = dist.get_world_size()
    grid = case_grid(split, world)
    model = tiny_wan_transformer(num_layers=3, num_attention_heads=world)
    convert_to_mhla(model, MHLAConfig(**mhla))
    _randomise_mhla(model)
    inputs = wan_inputs(frames=grid[0], height=grid[1], width=grid[2], batch=2)
    if grads:
        # ReLU's gradient jumps at 0: in float32 a pre-activation within rounding of 0 (one was at 3e-8) can
        # land on either side in the two runs, which differ by summation order, and flip its gradient. In
        # float64 the runs agree to ~1e-13, so the comparison measures the split, not that accident.
        model = model.double()
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    params = {name: p for name, p in model.named_parameters()}

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grads):
            out = model(**inputs, return_dict=False)[0]  # Diffusers' context-parallel hooks need a tuple output
            if not grads:
                return out, {}
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
            (out * weights).sum().backward()
        return out.detach(), {name: p.grad.clone() for name, p in params.items() if p.grad is not None}

    ref, ref_grads = run()
    enable_context_parallel(model, context_parallel_config(world, uneven=split == "uneven"))
    out, local_grads = run()
    disable_context_parallel(model)

    compared = {"output": _compare(out, ref)}
    for name in sorted(set(ref_grads) & set(local_grads)):
        compared[f"grad {name}"] = _compare(_summed(local_grads[name]), ref_grads[name])
    return {
        "tokens": math.prod(grid),
        "gradients in one run only": sorted(set(ref_grads) ^ set(local_grads)),
        "compared": compared,
    }


def transformer_suite() -> dict[str, dict[str, Any]]:
    """Every :data:`TRANSFORMER_CASES` entry on this process group."""
    return {name: transformer_case(**case) for name, case in TRANSFORMER_CASES.items()}


def refusals() -> dict[str, str]:
    """The messages of the set-ups context parallelism refuses (``"no error"`` where none was raised)."""
    from helpers.models import wan_inputs
    from mhla_diffusion.config import MHLAConfig
    from mhla_diffusion.models.context_parallel import (
        context_parallel_config,
        disable_context_parallel,
        enable_context_parallel,
    )
    from mhla_diffusion.models.conversion import convert_to_mhla
    from mhla_diffusion.models.tiny import tiny_wan_transformer

    world = dist.get_world_size()
    model = tiny_wan_transformer(num_layers=3, num_attention_heads=world)
    convert_to_mhla(model, MHLAConfig(layers="hybrid", layout=(1, 2, 2)))
    messages = {}

    def attempt(name: str, action) -> None:
        try:
            action()
            messages[name] = "no error"
        except (ValueError, RuntimeError) as error:
            messages[name] = str(error)

    attempt("degree is not the world size", lambda: enable_context_parallel(model, world + 1))
    attempt(
        "ring softmax layers on CPU",
        lambda: enable_context_parallel(model, context_parallel_config(world, softmax="ring")),
    )
    enable_context_parallel(model, world)
    attempt("enabled twice", lambda: enable_context_parallel(model, world))
    grid = case_grid("uneven", world)
    attempt(
        "uneven token count, even split",
        lambda: model(**wan_inputs(frames=grid[0], height=grid[1], width=grid[2]), return_dict=False),
    )
    disable_context_parallel(model)
    return messages


def wan_family_runs(wan_family_dirs: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Every Wan-family run of :data:`helpers.wan_family.RUNS` (Wan2.1 image-to-video, Wan2.2-TI2V-5B with its
    per-token timesteps, both Wan2.2-A14B transformers) in one process and split across this group."""
    from helpers.models import seeded
    from helpers.wan_family import RUNS, call_args, pipeline_class
    from mhla_diffusion.models.context_parallel import disable_context_parallel, enable_pipeline_context_parallel

    results = {}
    for variant, image_to_video in RUNS:
        pipe = pipeline_class(image_to_video).from_pretrained(
            wan_family_dirs[variant], mhla_weights=wan_family_dirs[f"{variant}-mhla"]
        )
        args = call_args(variant, image_to_video)
        ref = pipe(**args, generator=seeded(0)).frames[0]
        names = enable_pipeline_context_parallel(pipe, dist.get_world_size())
        split = pipe(**args, generator=seeded(0)).frames[0]
        for name in names:
            disable_context_parallel(getattr(pipe, name))
        results[f"{variant} {'image' if image_to_video else 'text'}-to-video ({len(names)} transformers)"] = _compare(
            torch.as_tensor(split), torch.as_tensor(ref)
        )
    return results


def parallel_suite(
    pipeline_dirs: dict[str, Any] | None = None,
    output_dir: str | None = None,
    wan_family_dirs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the context-parallel tests compare, in one start of the processes (with ``pipeline_dirs``
    and ``output_dir``, the pipeline and command-line runs; with ``wan_family_dirs``, the Wan family's)."""
    results = {"operator": operator_suite(), "transformer": transformer_suite(), "refusals": refusals()}
    if pipeline_dirs is not None:
        results["pipeline"] = pipeline_run(pipeline_dirs, output_dir)
    if wan_family_dirs is not None:
        results["wan family"] = wan_family_runs(wan_family_dirs)
    return results


# ----------------------------------------------------------------------------- pipeline and command line

#: The command-line video of the context-parallel tests: grid 3x2x3 (18 tokens) under the (2, 2, 2) layout.
CLI_VIDEO = [
    "--num-frames",
    "9",
    "--height",
    "32",
    "--width",
    "48",
    "--steps",
    "2",
    "--max-sequence-length",
    "16",
    "--prompt",
    "a red circle moving left",
    "--format",
    "frames",
]


def pipeline_run(pipeline_dirs: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """A tiny MHLA Wan pipeline's video in one process and split across this group; then the command line
    (``text-to-video --context-parallel P``, as under torchrun) and, on rank 0 only, its one-process run."""
    import contextlib
    import io
    import os
    from pathlib import Path

    from helpers.models import WAN_CALL, seeded
    from mhla_diffusion.cli import main
    from mhla_diffusion.models.context_parallel import disable_context_parallel, enable_pipeline_context_parallel
    from mhla_diffusion.pipelines import MHLAWanPipeline

    world, rank = dist.get_world_size(), dist.get_rank()
    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    ref = pipe(**WAN_CALL, generator=seeded(0)).frames[0]
    names = enable_pipeline_context_parallel(pipe, world)
    split = pipe(**WAN_CALL, generator=seeded(0)).frames[0]
    for name in names:
        disable_context_parallel(getattr(pipe, name))
    results: dict[str, Any] = {"pipeline": _compare(torch.as_tensor(split), torch.as_tensor(ref))}

    model = ["text-to-video", "--model", str(pipeline_dirs["wan"]), "--mhla-weights", str(pipeline_dirs["wan_mhla"])]
    out = Path(output_dir)
    if rank == 0:  # the one-process reference, before the others join rank 0 in the split run
        os.environ["WORLD_SIZE"] = "1"
        results["one-process exit code"] = main([*model, *CLI_VIDEO, "--output-dir", str(out / "one")])
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))  # what torchrun sets
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results["exit code"] = main(
            [*model, *CLI_VIDEO, "--output-dir", str(out / "split"), "--context-parallel", str(world)]
        )
    results["printed"] = printed.getvalue()
    results["mismatched degree"] = main(
        [*model, *CLI_VIDEO, "--output-dir", str(out / "bad"), "--context-parallel", str(world + 1)]
    )
    return results


# ----------------------------------------------------------------------------- training: data x context parallelism


def training_gradients(context_parallel_degree: int = 2) -> dict[str, Any]:
    """One training step of a tiny hybrid MHLA Wan under DDP across groups of ``context_parallel_degree``
    processes that split each batch's tokens (the trainer's :func:`enable_training_context_parallel` and
    ``loss_scale``), against the mean over the groups' batches of the one-process gradient."""
    from torch.nn.parallel import DistributedDataParallel

    from helpers.models import wan_inputs
    from mhla_diffusion.config import MHLAConfig
    from mhla_diffusion.models.context_parallel import enable_training_context_parallel
    from mhla_diffusion.models.conversion import convert_to_mhla
    from mhla_diffusion.models.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(num_layers=3, num_attention_heads=context_parallel_degree)
    convert_to_mhla(
        model, MHLAConfig(layers="hybrid", layout=(1, 2, 3), normalization="none", output_norm=True, gate=True)
    )
    _randomise_mhla(model)
    groups = dist.get_world_size() // context_parallel_degree
    batches = [wan_inputs(frames=2, height=5, width=7, batch=1, seed=10 + g) for g in range(groups)]
    weights = [torch.randn(1, 16, 2, 10, 14, generator=torch.Generator().manual_seed(20 + g)) for g in range(groups)]

    for inputs, w in zip(batches, weights):  # the reference: plain data parallelism's mean gradient, in one process
        ((model(**inputs, return_dict=False)[0] * w).sum() / groups).backward()
    ref = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    layout = enable_training_context_parallel(model, context_parallel_degree)
    ddp = DistributedDataParallel(model)
    group = layout.data_parallel_rank
    out = ddp(**batches[group], return_dict=False)[0]
    ((out * weights[group]).sum() * layout.loss_scale).backward()
    compared = {
        f"grad {name}": _compare(p.grad, ref[name]) for name, p in model.named_parameters() if p.grad is not None
    }
    return {
        "layout": (layout.data_parallel_size, layout.data_parallel_rank, layout.context_parallel_degree),
        "missing": sorted(set(ref) - {n for n, p in model.named_parameters() if p.grad is not None}),
        "compared": compared,
    }
