"""A DiT trained from random initialisation: the model as DiT builds it, its noise schedule, its VAE.

Diffusers' ``DiTTransformer2DModel`` is made for loading converted checkpoints, so its construction
leaves PyTorch's default initialisation and gives every block its own timestep + class embedder
(the conversion script copies DiT's single embedder into each). :func:`new_dit_transformer` builds
it as DiT does (``DiT.initialize_weights``):

* every ``nn.Linear`` xavier-uniform with zero bias; q, k and v drawn as DiT's one fused ``qkv``
  ``Linear(C, 3C)`` (a wider xavier bound than three separate ``C x C`` matrices);
* the patch embedding xavier-uniform over its flattened kernel, zero bias;
* the class table and the timestep MLP's two weights ``N(0, 0.02)``;
* the adaLN modulation of every block and of the final layer, and the final linear layer, zero
  (adaLN-Zero: each block starts as the identity and the model outputs zeros);
* with ``share_embedder`` (default): one timestep + class embedder shared by all blocks and the final
  layer, as DiT has one (Diffusers' per-block copies would train apart into ``depth`` embedders).
  It is saved as Diffusers' per-block copies (:func:`unshared_embedders`), so the saved model loads
  into the stock class.

MHLA layers (converted before the initialisation) get the same treatment: a gate ``Linear`` is
xavier-uniform, mixing and LePE keep their MHLA initialisation. One difference from DiT is kept on
purpose: the timestep sinusoid's frequencies are Diffusers' (``10000 ** (-i / 127)``, DiT's are
``/ 128``). Imported original weights need DiT's (``timestep_freq_shift: 0``, see
:func:`mhla_diffusion.models.transformers.set_timestep_freq_shift`), but a model trained here learns with
Diffusers' and is then sampled the same way by any loader, Diffusers' stock ``DiTPipeline`` included.

The saved pipeline's scheduler is a ``DDIMScheduler`` on DiT's schedule (1000 steps, linear betas
1e-4..0.02), as ``facebook/DiT-XL-2-256`` ships: Diffusers' ``DiTPipeline`` samples with the epsilon
half of the learned-sigma output; the learned range variance is trained by the VB loss.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..config import MHLAConfig
from ..loaders.plan import LoadPlan, resolve_source
from ..models.conversion import convert_to_mhla

__all__ = [
    "DIT_NOISE_SCHEDULE",
    "dit_scheduler",
    "has_shared_embedder",
    "initialize_dit_weights",
    "load_vae",
    "load_vae_config",
    "new_dit_transformer",
    "share_embedder",
    "unshared_embedders",
    "vae_location",
    "vae_plan",
]

#: DiT's (ADM's) noise schedule.
DIT_NOISE_SCHEDULE = dict(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02)


def dit_scheduler():
    """The pipeline scheduler of a DiT trained here: DDIM on DiT's schedule, no clipping (built, not downloaded)."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(**DIT_NOISE_SCHEDULE, clip_sample=False, prediction_type="epsilon")


# ---------------------------------------------------------------------- the VAE


def vae_plan(vae_model: str | LoadPlan) -> LoadPlan:
    """The :class:`~mhla_diffusion.loaders.plan.LoadPlan` of the VAE ``vae_model`` names: a pipeline's ``vae/``,
    else the folder or hub id itself (a plan is returned as it is)."""
    plan = resolve_source(vae_model)
    return plan.subplan("vae") if plan.form == "pipeline" else plan


def vae_location(vae_model: str | LoadPlan) -> tuple[str, str | None]:
    """``(source, subfolder)``: a pipeline's ``vae/``, else the folder or hub id itself."""
    plan = vae_plan(vae_model)
    return os.fspath(plan.source), plan.subfolder


def load_vae_config(vae_model: str | LoadPlan) -> dict[str, Any]:
    plan = vae_plan(vae_model)
    if plan.config is None:
        raise FileNotFoundError(
            f"vae_model {plan.where} has no config.json: it is {plan.describe()}; give a Diffusers VAE folder, a "
            "pipeline folder with a vae/, or a hub id"
        )
    return dict(plan.config)


def load_vae(vae_model: str | LoadPlan, dtype: torch.dtype | None = None) -> nn.Module:
    from diffusers import AutoencoderKL

    plan = vae_plan(vae_model)
    kwargs: dict[str, Any] = {"subfolder": plan.subfolder} if plan.subfolder else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return AutoencoderKL.from_pretrained(plan.source, **plan.hub_kwargs, **kwargs)


# ---------------------------------------------------------------------- the transformer


def new_dit_transformer(
    config: dict[str, Any], seed: int, mhla: MHLAConfig | None = None, share: bool = True, dit_init: bool = True
) -> nn.Module:
    """A ``DiTTransformer2DModel`` of ``config`` with DiT's initialisation (``dit_init=False``: torch's
    default initialisation of its layers), converted to MHLA with ``mhla`` (``None``: softmax
    attention); deterministic given ``seed``, global RNG untouched."""
    from diffusers import DiTTransformer2DModel

    known = set(inspect.signature(DiTTransformer2DModel.__init__).parameters) - {"self"}
    unknown = sorted(set(config) - known)
    if unknown:
        hints = [
            f"`{k}`" + (f" (did you mean `{c[0]}`?)" if (c := difflib.get_close_matches(k, known, n=1)) else "")
            for k in unknown
        ]
        raise ValueError(
            f"model_overrides: {', '.join(hints)} not DiTTransformer2DModel config entries; "
            f"known: {', '.join(sorted(known))}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = DiTTransformer2DModel(**config)
        if share:
            share_embedder(transformer)
        if mhla is not None:
            convert_to_mhla(transformer, mhla)
    if dit_init:
        initialize_dit_weights(transformer, torch.Generator().manual_seed(seed))
    return transformer


def share_embedder(transformer: nn.Module) -> None:
    """Make every block use block 0's timestep + class embedder (DiT's single ``t_embedder`` / ``y_embedder``)."""
    blocks = transformer.transformer_blocks
    for block in blocks[1:]:
        block.norm1.emb = blocks[0].norm1.emb


def has_shared_embedder(transformer: nn.Module) -> bool:
    blocks = transformer.transformer_blocks
    return any(block.norm1.emb is blocks[0].norm1.emb for block in blocks[1:])


@contextmanager
def unshared_embedders(transformer: nn.Module) -> Iterator[nn.Module]:
    """Inside: every block holds its own copy of the shared embedder (equal values), as Diffusers'
    class stores it, so ``save_pretrained`` / ``save_mhla`` write a stock model. Nothing to do when
    the model shares nothing."""
    blocks = transformer.transformer_blocks
    shared = blocks[0].norm1.emb
    tied = [block for block in blocks[1:] if block.norm1.emb is shared]
    with torch.no_grad():
        for block in tied:
            block.norm1.emb = copy.deepcopy(shared)
    try:
        yield transformer
    finally:
        for block in tied:
            block.norm1.emb = shared


@torch.no_grad()
def initialize_dit_weights(transformer: nn.Module, generator: torch.Generator | None = None) -> None:
    """DiT's ``initialize_weights`` on a (possibly MHLA-converted) ``DiTTransformer2DModel``, in place."""
    from diffusers.models.attention_processor import Attention

    def xavier(weight: torch.Tensor) -> None:
        flat = weight.view(weight.shape[0], -1)
        nn.init.xavier_uniform_(flat, generator=generator)

    for module in transformer.modules():  # each module once, a shared embedder too
        if isinstance(module, nn.Linear):
            xavier(module.weight)
            if module.bias is not None:
                module.bias.zero_()
    for module in transformer.modules():
        if isinstance(module, Attention) and _separate_qkv(module):
            fused = torch.empty(3 * module.to_q.out_features, module.to_q.in_features)
            nn.init.xavier_uniform_(fused, generator=generator)
            for linear, part in zip((module.to_q, module.to_k, module.to_v), fused.chunk(3)):
                linear.weight.copy_(part)
    proj = transformer.pos_embed.proj
    xavier(proj.weight)
    if proj.bias is not None:
        proj.bias.zero_()
    for block in transformer.transformer_blocks:
        emb = block.norm1.emb
        nn.init.normal_(emb.class_embedder.embedding_table.weight, std=0.02, generator=generator)
        nn.init.normal_(emb.timestep_embedder.linear_1.weight, std=0.02, generator=generator)
        nn.init.normal_(emb.timestep_embedder.linear_2.weight, std=0.02, generator=generator)
        _zero(block.norm1.linear)
    _zero(transformer.proj_out_1)
    _zero(transformer.proj_out_2)


def _separate_qkv(attn: nn.Module) -> bool:
    parts = [getattr(attn, name, None) for name in ("to_q", "to_k", "to_v")]
    return all(isinstance(p, nn.Linear) for p in parts) and len({tuple(p.weight.shape) for p in parts}) == 1


def _zero(linear: nn.Linear) -> None:
    linear.weight.zero_()
    if linear.bias is not None:
        linear.bias.zero_()
