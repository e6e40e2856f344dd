"""How MHLA processors learn the token grid without the user passing it.

Diffusers never tells an attention processor the token grid. A forward pre-hook on the transformer
reads the latent's shape on every call and writes the grid into a small shared object that the
model's MHLA processors read, so a new resolution or frame count on the next call just works.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TokenGridContext", "TokenGridHook", "install_grid_hook", "remove_grid_hook"]


class TokenGridContext:
    """Current token grid of one transformer (a plain object, deliberately not an ``nn.Module``)."""

    def __init__(self) -> None:
        self.grid: tuple[int, ...] | None = None

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


class TokenGridHook:
    """Forward pre-hook that records ``latent spatial shape // patch size`` in a :class:`TokenGridContext`.

    A callable object rather than a closure, so that ``copy.deepcopy(transformer)`` (EMA copies)
    gives the copy its own context shared with the copy's processors.
    """

    def __init__(self, context: TokenGridContext, patch_size: tuple[int, ...]) -> None:
        self.context = context
        self.patch_size = tuple(int(p) for p in patch_size)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        spatial = latents.shape[2:]
        if len(spatial) != len(self.patch_size):
            raise ValueError(
                f"expected latents with {len(self.patch_size)} grid axes after (B, C), got shape {tuple(latents.shape)}"
            )
        self.context.grid = tuple(int(s) // p for s, p in zip(spatial, self.patch_size))


def install_grid_hook(transformer: torch.nn.Module, patch_size: tuple[int, ...], context: TokenGridContext) -> None:
    """Make ``transformer`` record its token grid in ``context`` (replacing an earlier grid hook)."""
    remove_grid_hook(transformer)
    transformer.register_forward_pre_hook(TokenGridHook(context, patch_size), with_kwargs=True)


def remove_grid_hook(transformer: torch.nn.Module) -> None:
    """Detach the grid hook from ``transformer`` if it has one."""
    for key, hook in list(transformer._forward_pre_hooks.items()):
        if isinstance(hook, TokenGridHook):
            del transformer._forward_pre_hooks[key]
            transformer._forward_pre_hooks_with_kwargs.pop(key, None)
