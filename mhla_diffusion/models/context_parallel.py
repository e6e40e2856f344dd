"""Context parallelism for MHLA models: one video's tokens split across processes (GPUs or CPU processes).

The user-facing call is Diffusers' own::

    torch.distributed.init_process_group(...)            # torchrun --nproc_per_node P
    enable_context_parallel(transformer, ContextParallelConfig(ulysses_degree=P))

:func:`enable_context_parallel` does what ``transformer.enable_parallelism(config=...)`` does and, where
an accelerator is present, simply calls it. Diffusers' context-parallel hooks (``_cp_plan``) then split
the token sequence at ``blocks.0`` (and the RoPE tables) and gather it at ``proj_out``; every processor
that defines ``_parallel_config`` receives the config. MHLA processors define it, learn this process's
token range from the config's flattened ``(ring, ulysses)`` mesh and the whole token grid (recorded by
the grid pre-hook before the split), and all-reduce their block summaries
(:mod:`mhla_diffusion.ops.context_parallel`); softmax layers of a hybrid model use Diffusers'
Ulysses or ring attention as usual.

Why not only ``enable_parallelism``: in Diffusers 0.42 it picks the device as
``rank % torch.accelerator.device_count()``, which divides by zero on a machine without an accelerator,
so CPU processes (gloo; the tests, the communication benchmark) can not use it. On such a machine this
module runs the same steps -- ``ParallelConfig.setup`` on a CPU device mesh, the processors'
``_parallel_config``, ``apply_context_parallel`` with the model's ``_cp_plan`` -- itself.

Where Diffusers' split works, and where it does not (0.42):

* the default split (``torch.chunk``) needs ``N % P == 0``; ``ulysses_anything=True`` /
  ``ring_anything=True`` split any ``N >= P`` (``torch.tensor_split``). :func:`enable_context_parallel`
  installs a pre-hook that refuses an uneven ``N`` with a clear message before Diffusers' bare assertion.
* softmax layers (hybrid models): Ulysses runs on CPU / gloo (the native backend); ring attention needs
  a backend that returns the log-sum-exp (flash, cuDNN, sage: CUDA only), so ring is refused on CPU.
  Ulysses needs ``heads % P == 0`` unless ``ulysses_anything=True``.
* Ulysses-anything (the uneven split) has no backward in Diffusers 0.42: training hybrids needs the even split.
* on gloo, Diffusers' gather of unequal pieces fails (gloo's all-gather needs equal sizes) and its size
  exchange runs on the accelerator unless the backend string names ``cpu``: on CPU the uneven split
  needs ``init_process_group("cpu:gloo")``, and this module gathers through equal, padded pieces.
* the model must be called with ``return_dict=False`` (Diffusers' split hook on the model refuses its
  output dataclass); the pipelines and trainers do.
* models: those with a ``_cp_plan`` (Wan). DiT has none in Diffusers.
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..utils.sequence_split import split_sizes
from .conversion import _patch_size, model_family, self_attention_layers
from .processors.base import CAUSAL_CONTEXT_PARALLEL_ERROR, MHLAProcessor

__all__ = [
    "ParallelLayout",
    "context_parallel_config",
    "context_parallel_paused",
    "cpu_parallel_config",
    "context_parallel_degree",
    "describe",
    "disable_context_parallel",
    "enable_context_parallel",
    "enable_pipeline_context_parallel",
    "enable_training_context_parallel",
    "run_cpu_processes",
    "training_layout",
]


def context_parallel_config(degree: int, *, softmax: str = "ulysses", uneven: bool = False) -> Any:
    """A Diffusers ``ContextParallelConfig`` splitting the sequence over ``degree`` processes.

    ``softmax`` says how the softmax self-attention layers of a hybrid model attend across processes:
    ``"ulysses"`` (all-to-all; works on CPU) or ``"ring"`` (CUDA backends only). MHLA layers all-reduce
    their block summaries either way. ``uneven=True`` accepts token counts that ``degree`` does not
    divide (Diffusers' ``ulysses_anything`` / ``ring_anything``).
    """
    from diffusers import ContextParallelConfig

    if not isinstance(degree, int) or degree < 2:
        raise ValueError(
            f"the context-parallel degree must be an int >= 2 (1 means no context parallelism), got {degree!r}"
        )
    if softmax == "ulysses":
        return ContextParallelConfig(ulysses_degree=degree, ulysses_anything=uneven)
    if softmax == "ring":
        return ContextParallelConfig(ring_degree=degree, ring_anything=uneven)
    raise ValueError(f"`softmax` must be 'ulysses' or 'ring', got {softmax!r}")


def context_parallel_degree(transformer: nn.Module) -> int:
    """Processes the transformer's tokens are split across (1 without context parallelism)."""
    config = getattr(getattr(transformer, "_parallel_config", None), "context_parallel_config", None)
    return 1 if config is None else int(config.ring_degree * config.ulysses_degree)


class ContextParallelGridCheck:
    """Forward pre-hook: refuse a token grid Diffusers' split can not cut, with a message naming the fix,
    before Diffusers' hooks assert (``N % P``) deep inside the first block."""

    def __init__(self, patch_size: tuple[int, ...], degree: int, even: bool) -> None:
        self.patch_size, self.degree, self.even = tuple(patch_size), degree, even

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        grid = tuple(int(s) // p for s, p in zip(latents.shape[2:], self.patch_size))
        try:
            split_sizes(math.prod(grid), self.degree, self.even)
        except ValueError as error:
            raise ValueError(f"context parallelism over {self.degree} processes, token grid {grid}: {error}") from None


class _GatherPadded(torch.autograd.Function):
    """All-gather of unequal pieces along ``dim`` through equal, zero-padded ones (gloo's all_gather
    needs equal sizes); the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, sizes: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:rank]), sizes[rank]
        pad = [0, 0] * (x.ndim - 1 - dim) + [0, max(sizes) - x.shape[dim]]
        padded = torch.nn.functional.pad(x, pad).contiguous()
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)], dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return grad.narrow(ctx.dim, ctx.start, ctx.size), None, None, None


def _padded_gather_hook(plan: Any, config: Any) -> Any:
    """Diffusers' output gather hook, gathering unequal pieces (the uneven split) in a way gloo supports."""
    from diffusers.hooks.context_parallel import ContextParallelGatherHook
    from diffusers.models._modeling_parallel import gather_size_by_comm

    class PaddedGatherHook(ContextParallelGatherHook):
        def post_forward(self, module: nn.Module, output: Any) -> Any:
            single = isinstance(output, torch.Tensor)
            outputs = [output] if single else list(output)
            group = self.parallel_config._flattened_mesh.get_group()
            for i, cpm in enumerate(self.metadata):
                if cpm is not None:
                    sizes = tuple(gather_size_by_comm(outputs[i].shape[cpm.gather_dim], group))
                    outputs[i] = _GatherPadded.apply(outputs[i], cpm.gather_dim, group, sizes)
            return outputs[0] if single else tuple(outputs)

    return PaddedGatherHook(plan, config)


def _use_padded_gathers(transformer: nn.Module, config: Any) -> None:
    """Replace Diffusers' output gathers by :func:`_padded_gather_hook` (uneven split on gloo).

    Diffusers 0.42 gathers unequal pieces with ``dist.all_gather`` of unequal tensors, which NCCL
    accepts and gloo refuses ("invalid tensor size"); everything else of the split is Diffusers'.
    """
    from diffusers.hooks.context_parallel import _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE, _get_submodule_by_name
    from diffusers.hooks.hooks import HookRegistry
    from diffusers.models._modeling_parallel import ContextParallelOutput

    for module_id, plan in transformer._cp_plan.items():
        if isinstance(plan, dict):
            continue
        plan = [plan] if isinstance(plan, ContextParallelOutput) else list(plan)
        modules = _get_submodule_by_name(transformer, module_id)
        for module in modules if isinstance(modules, list) else [modules]:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            name = _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
            registry.remove_hook(name, recurse=False)
            registry.register_hook(_padded_gather_hook(plan, config), name)


def _attention_modules(transformer: nn.Module) -> list[nn.Module]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in transformer.modules() if isinstance(m, (Attention, AttentionModuleMixin))]


def _check_softmax_layers(transformer: nn.Module, config: Any, on_cpu: bool) -> None:
    """Refuse, before any work, a softmax self-attention setup Diffusers can not run across processes."""
    softmax = [
        (name, attn)
        for name, attn in self_attention_layers(transformer)
        if not isinstance(attn.processor, MHLAProcessor)
    ]
    if not softmax:
        return
    names = ", ".join(name for name, _ in softmax[:3]) + (" ..." if len(softmax) > 3 else "")
    if config.ring_degree > 1 and on_cpu:
        raise ValueError(
            f"ring attention for the softmax layers ({names}) needs an attention backend that returns the log-sum-exp "
            "(flash, cuDNN or sage: CUDA only); Diffusers' native backend does not, so on CPU use Ulysses: "
            "ContextParallelConfig(ulysses_degree=P) (--context-parallel-softmax ulysses)"
        )
    heads = softmax[0][1].heads
    if config.ulysses_degree > 1 and not config.ulysses_anything and heads % config.ulysses_degree:
        raise ValueError(
            f"Ulysses attention for the softmax layers ({names}) splits their {heads} heads across "
            f"{config.ulysses_degree} processes, which needs heads % {config.ulysses_degree} == 0: use "
            "ContextParallelConfig(ulysses_anything=True) (--context-parallel-uneven), "
            "or a degree that divides the heads"
        )


def cpu_parallel_config(config: Any) -> Any:
    """A Diffusers ``ParallelConfig`` for ``config`` (a ``ContextParallelConfig``) set up on a CPU device
    mesh, as ``ModelMixin._resolve_parallel_config`` does on an accelerator (torch.distributed initialised)."""
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = config.mesh or init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
    parallel = ParallelConfig(context_parallel_config=config)
    parallel.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    return parallel


def enable_context_parallel(transformer: nn.Module, config: Any) -> Any:
    """Split ``transformer``'s token sequence across the processes of Diffusers' context-parallel mesh.

    Args:
        transformer: a Diffusers transformer with a ``_cp_plan`` (Wan), converted to MHLA or not
            (hybrids too); every process must hold the same weights.
        config: a Diffusers ``ContextParallelConfig`` (see :func:`context_parallel_config`), or the
            degree ``P`` (``ulysses_degree=P``, even split).

    Causal MHLA layers (``MHLAConfig(causal=True)``) are refused: context parallelism is bidirectional only.
    Needs ``torch.distributed`` initialised (``torchrun --nproc_per_node P``); without a custom
    ``mesh`` in the config, ``ring_degree * ulysses_degree`` must equal the world size. Returns the
    Diffusers ``ParallelConfig`` set on the model and its attention processors. Calls the model's
    ``enable_parallelism`` where an accelerator exists, and does the same steps itself on CPU-only
    machines (see the module docstring). Undo with :func:`disable_context_parallel`.
    """
    from diffusers import ContextParallelConfig

    if any(getattr(module.processor, "causal", False) for module in _attention_modules(transformer)):
        raise ValueError(CAUSAL_CONTEXT_PARALLEL_ERROR)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context parallelism needs torch.distributed initialised first: launch with "
            "`torchrun --nproc_per_node P ...` and call torch.distributed.init_process_group() "
            "(backend nccl on GPUs, gloo on CPU)"
        )
    if isinstance(config, int):
        config = context_parallel_config(config)
    if not isinstance(config, ContextParallelConfig):
        raise TypeError(
            f"`config` must be a diffusers ContextParallelConfig or an int degree, got {type(config).__name__}"
        )
    degree, world = config.ring_degree * config.ulysses_degree, dist.get_world_size()
    if config.mesh is None and degree != world:
        raise ValueError(
            f"context-parallel degree {degree} (ring {config.ring_degree} x ulysses {config.ulysses_degree}) "
            f"must equal the number of processes ({world}): launch with torchrun --nproc_per_node {degree}, or pass "
            f"--context-parallel {world} (or a custom DeviceMesh with 'ring' and 'ulysses' dimensions)"
        )
    if getattr(transformer, "_cp_plan", None) is None:
        raise ValueError(
            f"{type(transformer).__name__} has no Diffusers context-parallel plan (`_cp_plan`): use a Wan transformer"
        )
    if getattr(transformer, "_parallel_config", None) is not None:
        raise RuntimeError("parallelism is already enabled on this transformer; call disable_context_parallel() first")
    on_cpu = torch.accelerator.device_count() == 0
    _check_softmax_layers(transformer, config, on_cpu)
    uneven = config.ulysses_anything or config.ring_anything
    if on_cpu and uneven and "cpu" not in str(dist.get_backend()):
        raise ValueError(
            f"the uneven split (ulysses_anything / ring_anything) on CPU needs the process group initialised with "
            f"backend 'cpu:gloo' (got {dist.get_backend()!r}): Diffusers 0.42 exchanges the ranks' token counts on "
            "the accelerator unless the backend string names 'cpu'; call init_process_group('cpu:gloo')"
        )

    if not on_cpu:
        transformer.enable_parallelism(config=config)
        parallel = transformer._parallel_config
    else:  # enable_parallelism's steps with a CPU device (it divides by the accelerator count)
        from diffusers.hooks.context_parallel import apply_context_parallel

        parallel = cpu_parallel_config(config)
        transformer._parallel_config = parallel
        for module in _attention_modules(transformer):
            if module.processor is not None and hasattr(module.processor, "_parallel_config"):
                module.processor._parallel_config = parallel
        apply_context_parallel(transformer, config, transformer._cp_plan)
        if uneven:
            _use_padded_gathers(transformer, config)
    for processor in getattr(
        transformer, "_mhla_original_processors", {}
    ).values():  # softmax_attention() swaps them in
        if hasattr(processor, "_parallel_config"):
            processor._parallel_config = parallel
    handle = transformer.register_forward_pre_hook(
        ContextParallelGridCheck(_patch_size(transformer), degree, even=not uneven), with_kwargs=True
    )
    transformer._mhla_context_parallel_check = handle
    return parallel


def disable_context_parallel(transformer: nn.Module) -> None:
    """Undo :func:`enable_context_parallel`: every process runs the whole sequence again."""
    from diffusers.hooks.context_parallel import remove_context_parallel

    if getattr(transformer, "_parallel_config", None) is None:
        raise ValueError("context parallelism is not enabled on this transformer")
    remove_context_parallel(transformer, transformer._cp_plan)
    processors = [module.processor for module in _attention_modules(transformer)]
    for processor in processors + list(getattr(transformer, "_mhla_original_processors", {}).values()):
        if processor is not None and getattr(processor, "_parallel_config", None) is not None:
            processor._parallel_config = None
    transformer._parallel_config = None
    handle = getattr(transformer, "_mhla_context_parallel_check", None)
    if handle is not None:
        handle.remove()
        del transformer._mhla_context_parallel_check


def describe(transformer: nn.Module) -> str:
    """One line: how the transformer's layers communicate under its context parallelism."""
    degree = context_parallel_degree(transformer)
    if degree == 1:
        return "context parallelism: off"
    layers = self_attention_layers(transformer)
    mhla, total = sum(isinstance(attn.processor, MHLAProcessor) for _, attn in layers), len(layers)
    config = transformer._parallel_config.context_parallel_config
    softmax = "ring" if config.ring_degree > 1 else "Ulysses"
    return (
        f"context parallelism over {degree} processes ({model_family(transformer)}): {mhla} MHLA layers all-reduce "
        f"block summaries, {total - mhla} softmax layers use {softmax}"
    )


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    result: tuple[str, Any]
    try:
        dist.init_process_group(  # "cpu:gloo", not "gloo": see enable_context_parallel's uneven-split check
            "cpu:gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=180),
        )
        try:
            result = ("ok", fn(*args))
            dist.barrier()  # a process that finishes first must not close its connections under the others
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    with open(Path(out_dir, f"rank{rank}.pkl"), "wb") as file:
        pickle.dump(result, file)


#: Modules the fork server of :func:`run_cpu_processes` imports before forking the processes.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "diffusers",
    "diffusers.models.transformers.transformer_wan",
    "mhla_diffusion.models.context_parallel",
)


def run_cpu_processes(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh CPU processes joined in a gloo process group.

    ``fn`` must be importable (a module-level function) and return something picklable; returns every
    rank's result in rank order. A process that raises makes this raise ``RuntimeError`` with its
    traceback; processes still running after ``timeout`` seconds are terminated (``TimeoutError``).
    Used by the context-parallel tests and the communication benchmark.
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"`world_size` must be >= 1, got {world_size}")
    # A fork server imports torch and Diffusers once per session; every process is then forked from it,
    # instead of each fresh interpreter importing them again (seconds each on a loaded CPU).
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    with tempfile.TemporaryDirectory(prefix="mhla-cp-") as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_worker, args=(rank, world_size, init_file, folder, fn, args), daemon=True)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for rank in stuck:
            processes[rank].terminate()
            processes[rank].join(10)
        if stuck:
            raise TimeoutError(
                f"context-parallel processes {stuck} of {world_size} still running after {timeout:.0f} s"
            )
        results = []
        for rank in range(world_size):
            path = Path(folder, f"rank{rank}.pkl")
            if not path.exists():
                raise RuntimeError(
                    f"process {rank} of {world_size} exited (code {processes[rank].exitcode}) without a result"
                )
            results.append(pickle.loads(path.read_bytes()))
    errors = [f"--- rank {rank} ---\n{value}" for rank, (status, value) in enumerate(results) if status == "error"]
    if errors:
        raise RuntimeError("context-parallel processes failed:\n" + "\n".join(errors))
    return [value for _, value in results]


#: Pipeline components that are transformers (Wan2.2-A14B has two: high- and low-noise).
TRANSFORMER_ATTRIBUTES = ("transformer", "transformer_2")


def enable_pipeline_context_parallel(pipe: Any, config: Any) -> list[str]:
    """:func:`enable_context_parallel` on every transformer of a Wan pipeline; returns their names.

    Every process runs the pipeline with the same inputs and seed (text encoding, scheduler and VAE
    are repeated on each); only the transformers split the video's tokens and gather them again, so
    each process ends with the same video.
    """
    names = [name for name in TRANSFORMER_ATTRIBUTES if getattr(pipe, name, None) is not None]
    if not names:
        raise ValueError(f"{type(pipe).__name__} has no transformer to split")
    for name in names:
        enable_context_parallel(getattr(pipe, name), config)
    return names


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class ParallelLayout:
    """How the processes of a training run share the work: ``data_parallel_size`` groups of
    ``context_parallel_degree`` processes; the processes of a group train on the same batch, each on
    its share of the tokens. Ranks ``g * degree .. (g + 1) * degree - 1`` form group ``g``."""

    data_parallel_size: int
    data_parallel_rank: int
    context_parallel_degree: int = 1

    @property
    def loss_scale(self) -> float:
        """Factor on the loss before backward so that data parallelism's gradient *mean* over every process
        gives the mean over the data-parallel groups of each group's full-sequence gradient.

        A process's gradients hold only its own tokens' part, and a group's parts add up to the
        full-sequence gradient; averaging over all ``P * degree`` processes divides by ``degree`` too
        many, which this factor undoes.
        """
        return float(self.context_parallel_degree)


def training_layout(context_parallel_degree: int = 1) -> ParallelLayout:
    """The :class:`ParallelLayout` of this process (a single process without torch.distributed)."""
    if not isinstance(context_parallel_degree, int) or context_parallel_degree < 1:
        raise ValueError(f"`context_parallel_degree` must be an int >= 1, got {context_parallel_degree!r}")
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if world % context_parallel_degree:
        raise ValueError(
            f"`context_parallel_degree` {context_parallel_degree} must divide the number of processes ({world}): "
            f"launch a multiple of {context_parallel_degree} processes (data parallelism x context parallelism)"
        )
    return ParallelLayout(world // context_parallel_degree, rank // context_parallel_degree, context_parallel_degree)


def enable_training_context_parallel(transformer: nn.Module, context_parallel_degree: int) -> ParallelLayout:
    """Split ``transformer``'s tokens across groups of ``context_parallel_degree`` processes, with data
    parallelism across the groups (a ``(data, ring, ulysses)`` device mesh, e.g. 2 x 1 x 2 on 4 processes).

    Softmax layers use Ulysses within a group. Returns this process's :class:`ParallelLayout`; scale the
    loss by its ``loss_scale`` before a data-parallel backward (DDP / FSDP average over all processes).
    """
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    layout = training_layout(context_parallel_degree)
    if context_parallel_degree == 1:
        return layout
    device_type = "cpu" if torch.accelerator.device_count() == 0 else torch._C._get_accelerator().type
    mesh = init_device_mesh(
        device_type, (layout.data_parallel_size, 1, context_parallel_degree), mesh_dim_names=("data", "ring", "ulysses")
    )
    enable_context_parallel(transformer, ContextParallelConfig(ulysses_degree=context_parallel_degree, mesh=mesh))
    return layout


@contextmanager
def context_parallel_paused(transformer: nn.Module) -> Iterator[nn.Module]:
    """Inside the block the transformer runs the whole sequence in this process alone (e.g. validation
    samples on the main process only); its context parallelism is back on exit. Runs no collective."""
    from diffusers.hooks.context_parallel import apply_context_parallel, remove_context_parallel

    parallel = getattr(transformer, "_parallel_config", None)
    if parallel is None:
        yield transformer
        return
    config = parallel.context_parallel_config
    holders = [m.processor for m in _attention_modules(transformer)]
    holders += list(getattr(transformer, "_mhla_original_processors", {}).values())
    holders = [p for p in holders if p is not None and getattr(p, "_parallel_config", None) is parallel]
    check = getattr(transformer, "_mhla_context_parallel_check", None)
    remove_context_parallel(transformer, transformer._cp_plan)
    for processor in holders:
        processor._parallel_config = None
    check_hook = transformer._forward_pre_hooks.pop(check.id) if check is not None else None
    transformer._parallel_config = None
    try:
        yield transformer
    finally:
        transformer._parallel_config = parallel
        apply_context_parallel(transformer, config, transformer._cp_plan)
        if config.ulysses_anything or config.ring_anything:
            if torch.accelerator.device_count() == 0:
                _use_padded_gathers(transformer, config)
        for processor in holders:
            processor._parallel_config = parallel
        if check_hook is not None:
            transformer._forward_pre_hooks[check.id] = check_hook
