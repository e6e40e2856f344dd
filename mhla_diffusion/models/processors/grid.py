"""How MHLA processors learn the token grid without the user passing it.

Diffusers never tells an attention processor the token grid. A forward pre-hook on the transformer
reads the latent's shape on every call and writes the grid into a small shared object that the
model's MHLA processors read, so a new resolution or frame count on the next call just works.

The same object builds the :class:`~mhla_diffusion.ops.block_layout.BlockPlan` (and so checks the grid
against the block layout) once per forward for each layout and device, and every MHLA layer of
that forward reuses it, instead of every attention call building its own.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...ops.block_layout import BlockPlan, block_plan
from ...ops.context_parallel import LocalBlockPlan, local_block_plan

__all__ = [
    "LatentGrid",
    "PositionIdGrid",
    "SizeArgumentGrid",
    "TokenGridContext",
    "TokenGridHook",
    "install_grid_hook",
    "remove_grid_hook",
]


class TokenGridContext:
    """Current token grid of one transformer (a plain object, deliberately not an ``nn.Module``).

    Holds the grid of the running forward and the block plans built for it; :meth:`set_grid`
    (called by the hook on every forward) drops the plans of the previous forward.
    """

    def __init__(self) -> None:
        self.grid: tuple[int, ...] | None = None
        self._plans: dict[tuple, BlockPlan | LocalBlockPlan] = {}

    def set_grid(self, grid: Sequence[int] | None) -> None:
        """Record the grid of a new forward and forget the block plans of the previous one."""
        self.grid = None if grid is None else tuple(int(g) for g in grid)
        self._plans.clear()

    def require(self, num_tokens: int) -> tuple[int, ...]:
        """The grid for an input of ``num_tokens`` tokens, or a clear error."""
        grid = self.grid
        if grid is None:
            raise RuntimeError(
                "MHLA processor does not know the token grid: call the transformer itself (its forward "
                "pre-hook records the grid), not the attention layer on its own"
            )
        size = 1
        for g in grid:
            size *= g
        if size != num_tokens:
            raise RuntimeError(
                f"MHLA processor got {num_tokens} tokens but the transformer's input grid {grid} has {size}; "
                "self-attention must see every latent token in row-major order"
            )
        return grid

    def require_total(self) -> int:
        """Tokens of the current grid (the whole sequence, before any context-parallel split), or a clear error."""
        if self.grid is None:
            self.require(0)  # raises: no grid recorded
        size = 1
        for g in self.grid:
            size *= g
        return size

    def plan(self, layout: Sequence[int], device: torch.device | str, grid: Sequence[int] | None = None) -> BlockPlan:
        """The block plan of the current grid (or of ``grid``, e.g. one copy of a teacher-forced input) cut by
        ``layout`` on ``device``, built once per forward.

        The first call of a forward for a layout and device builds the plan, and with it checks the
        grid against the layout (a clear ``ValueError`` when their axes differ; a grid with fewer
        tokens than blocks on an axis is fine, its extra blocks are empty); later calls of the same
        forward return the same plan. Under ``torch.compile`` the plan is built in the graph
        and not cached (the compiled graph holds no Python-side state).
        """
        if self.grid is None:
            raise RuntimeError(
                "MHLA processor does not know the token grid: call the transformer itself (its forward "
                "pre-hook records the grid), not the attention layer on its own"
            )
        grid = self.grid if grid is None else tuple(int(g) for g in grid)
        layout, device = tuple(layout), torch.device(device)
        if torch.compiler.is_compiling():
            return self._build(grid, layout, device)
        # The grid is part of the key, so a grid set without set_grid never meets a stale plan; so is
        # inference mode, whose index tensors cannot be saved for backward outside it.
        key = (grid, layout, device, torch.is_inference_mode_enabled())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._build(grid, layout, device)
        return plan

    def local_plan(self, layout: Sequence[int], device: torch.device | str, start: int, stop: int) -> LocalBlockPlan:
        """The :class:`~mhla_diffusion.ops.context_parallel.LocalBlockPlan` of tokens ``start .. stop - 1``
        (this process's share of the sequence under context parallelism), built once per forward like :meth:`plan`."""
        plan = self.plan(layout, device)
        if torch.compiler.is_compiling():
            return local_block_plan(plan, start, stop)
        key = ("local", plan.grid, plan.layout, torch.device(device), torch.is_inference_mode_enabled(), start, stop)
        local = self._plans.get(key)
        if local is None:
            local = self._plans[key] = local_block_plan(plan, start, stop)
        return local

    @staticmethod
    def _build(grid: tuple[int, ...], layout: tuple[int, ...], device: torch.device) -> BlockPlan:
        try:
            return block_plan(grid, layout, device=device)
        except ValueError as error:
            raise ValueError(
                f"the MHLA block layout {layout} does not fit this forward's token grid {grid} (latent size // "
                f"patch size): {error}"
            ) from None

    def __getstate__(self) -> dict[str, Any]:
        # copies (EMA, pickling) keep the grid but not the plans of the forward in progress
        return {**self.__dict__, "_plans": {}}


class LatentGrid:
    """The token grid of a latent input ``(B, C, *sizes)`` (``frames_first``: ``(B, F, C, H, W)``, CogVideoX):
    ``sizes // patch_size`` per axis."""

    def __init__(self, patch_size: Sequence[int], frames_first: bool = False) -> None:
        self.patch_size, self.frames_first = tuple(int(p) for p in patch_size), frames_first

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...]:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        shape = tuple(latents.shape)
        sizes = (shape[1], *shape[3:]) if self.frames_first else shape[2:]
        if len(sizes) != len(self.patch_size) or len(shape) != len(self.patch_size) + 2:
            layout = "(B, F, C, H, W)" if self.frames_first else f"(B, C, {len(self.patch_size)} grid axes)"
            raise ValueError(f"expected latents {layout}, got shape {shape}")
        return tuple(int(s) // p for s, p in zip(sizes, self.patch_size))


class SizeArgumentGrid:
    """The token grid of a packed input ``(B, N, C)`` whose forward takes its latent sizes as arguments (LTX-Video:
    ``num_frames``, ``height``, ``width``), divided by the patch size per axis."""

    def __init__(self, patch_size: Sequence[int], names: Sequence[str] = ("num_frames", "height", "width")) -> None:
        self.patch_size, self.names = tuple(int(p) for p in patch_size), tuple(names)

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...]:
        missing = [name for name in self.names if kwargs.get(name) is None]
        if missing:
            raise ValueError(
                f"MHLA needs the token grid: call the transformer with {', '.join(f'`{n}=`' for n in self.names)} "
                f"(the latent sizes; missing {', '.join(missing)})"
            )
        return tuple(int(kwargs[name]) // p for name, p in zip(self.names, self.patch_size))


class PositionIdGrid:
    """The token grid of packed image tokens whose positions come as ids ``(N, 3)`` = ``(0, row, column)`` in
    row-major order (Flux: ``img_ids``; a deprecated ``(B, N, 3)`` is read from its first sample). The text ids
    (``txt_ids``) must be all zero, as ``FluxPipeline`` makes them: RoPE then leaves the text tokens unrotated,
    and MHLA's text block has no positions. Both are checked once per forward, here."""

    def __init__(self, name: str = "img_ids", text_name: str = "txt_ids") -> None:
        self.name, self.text_name = name, text_name

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...]:
        text_ids = kwargs.get(self.text_name)
        if text_ids is not None and bool(text_ids.any()):
            raise ValueError(
                "MHLA's text block has no positions: Flux's text tokens must not rotate (`txt_ids` all zero, as "
                "FluxPipeline makes them)"
            )
        ids = kwargs.get(self.name)
        if ids is None:
            raise ValueError(f"MHLA needs the token grid: call the transformer with `{self.name}=` (the image ids)")
        ids = ids[0] if ids.ndim == 3 else ids
        rows, columns = (int(ids[:, axis].max().item()) + 1 for axis in (1, 2))
        expected = torch.stack(
            torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij"), dim=-1
        ).reshape(-1, 2)
        if ids.shape[0] != rows * columns or not torch.equal(ids[:, 1:].round().long().cpu(), expected):
            raise ValueError(
                f"MHLA cannot know the token grid: `{self.name}` {tuple(ids.shape)} are not the (0, row, column) "
                "ids of one row-major image (as FluxPipeline makes them); pass the image's own ids"
            )
        return rows, columns


class TokenGridHook:
    """Forward pre-hook that records the token grid of every call in a :class:`TokenGridContext`, as ``grid_of``
    (a :class:`LatentGrid`, :class:`SizeArgumentGrid` or :class:`PositionIdGrid`) reads it from the call.

    A callable object rather than a closure, so that ``copy.deepcopy(transformer)`` (EMA copies)
    gives the copy its own context shared with the copy's processors.
    """

    def __init__(self, context: TokenGridContext, grid_of: Any) -> None:
        self.context = context
        self.grid_of = grid_of if callable(grid_of) else LatentGrid(grid_of)  # a patch size: latents (B, C, ...)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.context.set_grid(self.grid_of(args, kwargs))


def install_grid_hook(transformer: torch.nn.Module, grid_of: Any, context: TokenGridContext) -> None:
    """Make ``transformer`` record its token grid in ``context`` (replacing an earlier grid hook); ``grid_of``: a
    grid reader (:class:`LatentGrid`, ...) or the patch size of a latent input ``(B, C, *sizes)``."""
    remove_grid_hook(transformer)
    transformer.register_forward_pre_hook(TokenGridHook(context, grid_of), with_kwargs=True)


def remove_grid_hook(transformer: torch.nn.Module) -> None:
    """Detach the grid hook from ``transformer`` if it has one."""
    for key, hook in list(transformer._forward_pre_hooks.items()):
        if isinstance(hook, TokenGridHook):
            del transformer._forward_pre_hooks[key]
            transformer._forward_pre_hooks_with_kwargs.pop(key, None)
