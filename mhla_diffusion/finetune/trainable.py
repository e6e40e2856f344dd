"""Which parameters train: all, the new MHLA ones, the MHLA self-attention layers, or LoRA + MHLA.

* ``all``: every parameter (the reference's full fine-tune).
* ``mhla``: the processors' own parameters (mixing, gate, output norm, LePE): ``<layer>.processor.*``.
* ``attention``: those plus the converted self-attention layers' projections and q/k norms.
* ``lora``: a PEFT LoRA adapter on the base weights (``lora_target_modules``, as Diffusers' LoRA
  training scripts) and the MHLA processor parameters in full.

A model without MHLA layers (``attention: softmax`` runs) trains with ``all`` or ``lora`` (the adapter).
"""

from __future__ import annotations

from torch import nn

from ..models.conversion import get_mhla_conversion

__all__ = ["add_lora", "attention_parameter_names", "mhla_processor_parameter_names", "set_trainable"]


def _converted_layers(model: nn.Module) -> list[str]:
    conversion = get_mhla_conversion(model)
    if conversion is None:
        raise ValueError("the transformer has no MHLA layers")
    return conversion.layer_names


def mhla_processor_parameter_names(model: nn.Module) -> list[str]:
    """``<layer>.processor.<name>`` of every MHLA processor parameter (frozen ones included)."""
    prefixes = tuple(f"{name}.processor." for name in _converted_layers(model))
    return [name for name, _ in model.named_parameters() if name.startswith(prefixes)]


def attention_parameter_names(model: nn.Module) -> list[str]:
    """Every parameter of the converted self-attention modules (projections, norms, MHLA processor)."""
    prefixes = tuple(f"{name}." for name in _converted_layers(model))
    return [name for name, _ in model.named_parameters() if name.startswith(prefixes)]


def add_lora(model: nn.Module, rank: int, alpha: int, target_modules: list[str]) -> None:
    """Attach a PEFT LoRA adapter (Gaussian A, zero B: the model is unchanged at step 0)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ImportError("trainable: lora needs peft: pip install peft") from None
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} | {
        name for name, _ in model.named_modules()
    }
    unknown = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in present)]
    if unknown:
        raise ValueError(f"lora_target_modules {unknown} match no module of the transformer")
    model.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(target_modules))
    )


def set_trainable(model: nn.Module, mode: str) -> list[str]:
    """Set ``requires_grad`` for ``mode`` and return the names of the parameters that train.

    Frozen-by-design MHLA parameters (``learnable_mixing: false``) stay frozen in every mode.
    """
    frozen_by_config = set()
    conversion = get_mhla_conversion(model)
    if conversion is not None and not conversion.config.learnable_mixing:
        frozen_by_config = {n for n in mhla_processor_parameter_names(model) if n.endswith(".processor.mixing")}
    if mode == "all":
        chosen = {name for name, _ in model.named_parameters()}
    elif mode == "mhla":
        chosen = set(mhla_processor_parameter_names(model))
    elif mode == "attention":
        chosen = set(attention_parameter_names(model))
    elif mode == "lora":  # (a softmax model, without MHLA layers: the adapter only)
        chosen = {name for name, _ in model.named_parameters() if ".lora_" in name}
        if conversion is not None:
            chosen |= set(mhla_processor_parameter_names(model))
        if not any(".lora_" in name for name in chosen):
            raise ValueError("trainable: lora, but the transformer has no LoRA adapter: call add_lora first")
    else:
        raise ValueError(f"unknown trainable mode {mode!r}")
    chosen -= frozen_by_config
    for name, param in model.named_parameters():
        param.requires_grad_(name in chosen)
    names = [name for name, _ in model.named_parameters() if name in chosen]
    if not names:
        raise ValueError(f"trainable: {mode} selects no parameter (are all MHLA parameters frozen by the config?)")
    return names
