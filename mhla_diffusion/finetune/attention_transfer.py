"""Attention transfer: an optional first stage in which every MHLA layer learns to reproduce the
output of its frozen softmax original on the same input hidden states (layer-wise MSE).

A forward hook on each converted self-attention module runs the original softmax processor on the
module's own inputs and records ``MSE(mhla output, softmax output)``. With teacher forcing (default)
the hook then returns the softmax output, so every later layer sees the hidden states of the
original model and the layers learn independently. What trains: the MHLA processor parameters and
the layer's projections and q/k norms (``params: attention``; the teacher is then a frozen copy of
the layer as it was), or only the processor parameters (``params: mhla``; the teacher shares the
frozen projections). The new parameters alone (a few mixing coefficients per layer) can do little
to match softmax; ``attention`` is what the trainers use unless only MHLA / LoRA weights are saved.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.conversion import get_mhla_conversion
from .trainable import attention_parameter_names, mhla_processor_parameter_names

__all__ = ["AttentionTransfer"]


class AttentionTransfer:
    """Layer-wise distillation of MHLA layers from their softmax originals (use as a context manager).

    Args:
        transformer: a converted transformer of any family (unwrapped).
        params: ``mhla`` or ``attention`` (see module docstring).
        teacher_forcing: pass the softmax output on to the rest of the network.
    """

    def __init__(self, transformer: nn.Module, params: str = "mhla", teacher_forcing: bool = True) -> None:
        conversion = get_mhla_conversion(transformer)
        if conversion is None:
            raise ValueError("attention transfer needs a transformer converted to MHLA")
        if params not in ("mhla", "attention"):
            raise ValueError(f"`params` must be 'mhla' or 'attention', got {params!r}")
        modules = dict(transformer.named_modules())
        self.transformer, self.params, self.teacher_forcing = transformer, params, teacher_forcing
        self.layer_names = list(conversion.layer_names)
        self.students = {name: modules[name] for name in self.layer_names}
        self.originals = dict(transformer._mhla_original_processors)
        self.teachers: dict[str, nn.Module] = {}
        if params == "attention":  # the student's projections will move: keep the softmax layer as it is now
            for name, attn in self.students.items():
                teacher = copy.deepcopy(attn)
                teacher.set_processor(self.originals[name])
                self.teachers[name] = teacher.requires_grad_(False).eval()
        self.losses: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []

    def parameter_names(self) -> list[str]:
        """Names (in the transformer) of the parameters this stage trains."""
        names = (
            mhla_processor_parameter_names(self.transformer)
            if self.params == "mhla"
            else attention_parameter_names(self.transformer)
        )
        params = dict(self.transformer.named_parameters())
        conversion = get_mhla_conversion(self.transformer)
        if not conversion.config.learnable_mixing:
            names = [n for n in names if not n.endswith(".processor.mixing")]
        return [n for n in names if n in params]

    def to(self, device: torch.device | str) -> "AttentionTransfer":
        for teacher in self.teachers.values():
            teacher.to(device)
        return self

    def _hook(self, name: str):
        student = self.students[name]

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
            with torch.no_grad():
                if name in self.teachers:
                    target = self.teachers[name](*args, **kwargs)
                else:
                    target = self.originals[name](student, *args, **kwargs)
            self.losses[name] = _mse(output, target)
            if not self.teacher_forcing:
                return None
            if isinstance(output, tuple):  # joint attention: (image, text) outputs
                return tuple(t.to(o.dtype) for t, o in zip(target, output))
            return target.to(output.dtype)

        return hook

    def _tie_output(self, module: nn.Module, args: tuple, output: Any) -> Any:
        # With teacher forcing the model output no longer depends on the MHLA parameters. DDP
        # (find_unused_parameters) decides what to all-reduce by walking back from the output, so
        # a zero-weighted copy of the distillation loss keeps those parameters on the path.
        tie = 0.0 * self.loss()
        if isinstance(output, tuple):
            return (output[0] + tie.to(output[0].dtype),) + tuple(output[1:])
        output.sample = output.sample + tie.to(output.sample.dtype)
        return output

    def __enter__(self) -> "AttentionTransfer":
        self.losses = {}
        for name, module in self.students.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        self._handles.append(self.transformer.register_forward_hook(self._tie_output))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def loss(self) -> torch.Tensor:
        """Mean of the per-layer MSEs of the last forward pass."""
        missing = [n for n in self.layer_names if n not in self.losses]
        if missing:
            raise RuntimeError(f"no distillation loss recorded for {missing}: run the transformer inside the context")
        return torch.stack([self.losses[n] for n in self.layer_names]).mean()

    def layer_metrics(self) -> dict[str, float]:
        """``{"transfer/<layer>": loss}`` of the last forward pass."""
        return {
            f"transfer/{name}": float(self.losses[name].detach()) for name in self.layer_names if name in self.losses
        }


def _mse(output: torch.Tensor | tuple, target: torch.Tensor | tuple) -> torch.Tensor:
    """Mean squared error over every element of a layer's output: one tensor, or the image and text outputs of a
    joint-attention layer (HunyuanVideo, CogVideoX, Flux) taken together."""
    if not isinstance(output, tuple):
        return F.mse_loss(output.float(), target.float())
    pairs = [(o, t) for o, t in zip(output, target) if o is not None]
    total = sum(F.mse_loss(o.float(), t.float(), reduction="sum") for o, t in pairs)
    return total / sum(o.numel() for o, _ in pairs)
