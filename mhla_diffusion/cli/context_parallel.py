"""``--context-parallel P`` of the video commands: one video's tokens split across P processes.

    torchrun --nproc_per_node 2 -m mhla_diffusion.cli text-to-video --context-parallel 2 --model ... --prompt ...

Every process runs the same command (same prompt, seed and settings); the transformers split the
video's tokens across the processes (:mod:`mhla_diffusion.models.context_parallel`), and only rank 0 writes
the outputs. The checks that need no model run on every process before anything loads: the degree
against the number of launched processes (``WORLD_SIZE``, set by ``torchrun`` and ``accelerate
launch``) and the video's token count against the split. Standard library only at module level.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .arguments import positive_int

__all__ = ["ContextParallelRun", "add_context_parallel_arguments", "check_context_parallel", "start_context_parallel"]


def add_context_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("context parallelism (one video across several processes / GPUs)")
    group.add_argument(
        "--context-parallel",
        type=positive_int,
        default=1,
        metavar="P",
        help="split each video's tokens across P processes launched with "
        "`torchrun --nproc_per_node P -m mhla_diffusion.cli ...` (default 1: off); MHLA layers all-reduce "
        "their block summaries (traffic fixed by the block layout), softmax layers use Diffusers' "
        "Ulysses or ring attention; only rank 0 writes outputs",
    )
    group.add_argument(
        "--context-parallel-softmax",
        choices=("ulysses", "ring"),
        default="ulysses",
        help="how softmax self-attention layers (hybrid models, --attention softmax) attend across "
        "processes: ulysses (default; also on CPU) or ring (CUDA attention backends only)",
    )
    group.add_argument(
        "--context-parallel-uneven",
        action="store_true",
        help="accept videos whose token count P does not divide (Diffusers' ulysses_anything / "
        "ring_anything; no backward for Ulysses, which generation does not need)",
    )


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"the environment's WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def check_context_parallel(args: argparse.Namespace, grid: Sequence[int]) -> None:
    """Refuse, before anything loads, a degree that does not match the launch or a video the split can not cut.

    ``grid``: the video's token grid. With ``--attention softmax`` and Ulysses, the transformer's heads
    (from a local ``--model`` folder's config) must split across the processes too.
    """
    from ..utils.geometry import read_component_config
    from ..utils.sequence_split import split_sizes

    degree, world = args.context_parallel, _world_size()
    if degree < 1:
        raise ValueError(f"--context-parallel must be >= 1, got {degree}")
    if degree == 1:
        if world > 1:
            raise ValueError(
                f"{world} processes were launched (WORLD_SIZE={world}) but --context-parallel is 1: every process "
                f"would generate the same video; pass --context-parallel {world} to split each video across them, "
                "or launch one process"
            )
        return
    if world != degree:
        launched = (
            "one process was launched (no torchrun)" if "WORLD_SIZE" not in os.environ else f"{world} were launched"
        )
        raise ValueError(
            f"--context-parallel {degree} needs {degree} processes but {launched}: run "
            f"`torchrun --nproc_per_node {degree} -m mhla_diffusion.cli {args.command} --context-parallel {degree} ...`"
        )
    uneven = args.context_parallel_uneven
    try:
        split_sizes(math.prod(grid), degree, even=not uneven)
    except ValueError as error:
        raise ValueError(f"a video of {'x'.join(map(str, grid))} tokens: {error}") from None
    heads = (read_component_config(args.model, "transformer") or {}).get("num_attention_heads")
    if (
        getattr(args, "attention", "mhla") == "softmax"
        and args.context_parallel_softmax == "ulysses"
        and heads is not None
        and heads % degree
        and not uneven
    ):
        raise ValueError(
            f"--attention softmax with Ulysses splits the model's {heads} attention heads across {degree} "
            "processes, which needs heads % P == 0: pass --context-parallel-uneven, or another degree"
        )
    if args.context_parallel_softmax == "ring" and (args.device or "").startswith("cpu"):
        raise ValueError(
            "--context-parallel-softmax ring needs a CUDA attention backend (flash, cuDNN, sage); on the "
            "CPU use --context-parallel-softmax ulysses"
        )


@dataclass
class ContextParallelRun:
    """The process group of a context-parallel command (rank, world) and what only rank 0 does."""

    rank: int
    world_size: int
    #: Whether this command started the process group (and so ends it).
    owns_group: bool = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def on_main(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on rank 0, its result (or its error) handed to every process."""
        import torch.distributed as dist

        outcome: list[Any] = [None]
        if self.is_main:
            try:
                outcome[0] = ("ok", fn(*args, **kwargs))
            except (ValueError, TypeError, OSError) as error:
                outcome[0] = ("error", error)
        dist.broadcast_object_list(outcome, src=0)
        status, value = outcome[0]
        if status == "error":
            raise value
        return value

    def enable(self, pipe: Any, args: argparse.Namespace) -> None:
        """Split the pipeline's transformers across the processes."""
        from ..models.context_parallel import context_parallel_config, describe, enable_pipeline_context_parallel

        config = context_parallel_config(
            self.world_size, softmax=args.context_parallel_softmax, uneven=args.context_parallel_uneven
        )
        for name in enable_pipeline_context_parallel(pipe, config):
            if self.is_main:
                print(f"{name}: {describe(getattr(pipe, name))}")

    def close(self) -> None:
        """End the process group if this command started it."""
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def start_context_parallel(args: argparse.Namespace) -> ContextParallelRun | None:
    """Join the launched processes (``None`` without ``--context-parallel``): NCCL for CUDA tensors and
    gloo for CPU ones on a GPU machine (each process on GPU ``LOCAL_RANK``), ``cpu:gloo`` otherwise."""
    if args.context_parallel == 1:
        return None
    import torch
    import torch.distributed as dist

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.context_parallel_softmax == "ring" and device.startswith("cpu"):
        raise ValueError(
            "--context-parallel-softmax ring needs a CUDA attention backend (flash, cuDNN, sage); on the "
            "CPU use --context-parallel-softmax ulysses"
        )
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "cpu:gloo"  # "cpu" in the name: Diffusers exchanges the uneven split's sizes on the CPU then
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(backend)
    return ContextParallelRun(dist.get_rank(), dist.get_world_size(), owns_group=started)
