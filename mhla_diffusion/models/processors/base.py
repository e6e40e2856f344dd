"""Parameters and shared steps of the MHLA attention processors.

A processor is an ``nn.Module`` set as ``attn.processor`` of one self-attention layer, so its
parameters live in the transformer's ``state_dict`` as ``<layer>.processor.<name>``:

* ``mixing``: ``(M, M)`` or ``(H, M, M)`` block-mixing coefficients; for causal MHLA (``MHLAConfig.causal``)
  ``(K + 2, S, S)`` or ``(H, K + 2, S, S)``, one matrix per temporal offset and one for the fold
  (:mod:`~mhla_diffusion.ops.causal`),
* ``fold_decay_logit``: ``(H,)`` logits of the causal fold's decay per head (``causal_fold="decay"`` only),
* ``out_norm.weight``: ``(head_dim,)`` per-head output RMSNorm (optional),
* ``gate.weight``, ``gate.bias``: SiLU output gate ``Linear(C, C)`` (optional),
* ``lepe.weight``, ``lepe.bias``: depthwise convolution of ``v`` over the token grid (optional),
* ``input_norm.weight``, ``input_norm.bias``: ``LayerNorm(C, eps=1e-5)`` of the attention's input
  before the q/k/v projections (optional; released DiT-MHLA). Output dropout has no parameters.

The math lives in :func:`mhla_attention`; processors only project, apply the feature map and RoPE,
and add the optional extras around it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...config import MHLAConfig
from ...ops.attention import HALF_DTYPES, mhla_attention
from ...ops.block_layout import BlockPlan, num_blocks
from ...ops.causal import causal_mixing_init, mhla_causal_attention, mhla_causal_step
from ...ops.context_parallel import TokenShard, grid_conv_context_parallel, mhla_attention_context_parallel
from ...ops.fused_op import mhla_attention_fused  # one custom op: torch.compile keeps the kernels
from ...ops.joint import joint_mixing_init, mhla_joint_attention
from ...ops.mixing import mixing_init
from ...ops.teacher_forcing import mhla_causal_teacher_forcing
from ...ops.triton_mhla import fused_available
from ...utils.geometry import check_equal_blocks
from .grid import TokenGridContext

__all__ = [
    "CAUSAL_CONTEXT_PARALLEL_ERROR",
    "CAUSAL_DECAY_INIT",
    "FP32_PARAMETERS",
    "MHLAProcessor",
    "apply_interleaved_rotary",
    "head_rms_norm",
    "kept_in_fp32",
    "rotary_rows",
]

#: The processor parameters (by first name component) that stay float32 when the model is cast to a half
#: type, as Diffusers' ``_keep_in_fp32_modules`` keeps its norms: the block mixing stays near its
#: initialisation, where bf16's 8-bit mantissa drops small updates (1 + 1e-3 rounds to 1), and the
#: norms are tiny and computed in float32 anyway. The gate and LePE follow the model's dtype like the
#: q/k/v projections beside them.
FP32_PARAMETERS = ("mixing", "fold_decay_logit", "out_norm", "input_norm")

#: The causal fold's decay per row of age at initialisation (``causal_fold="decay"``).
CAUSAL_DECAY_INIT = 0.9


def kept_in_fp32(name: str) -> bool:
    """Whether the transformer's tensor ``name`` (``<layer>.processor.<parameter>``) stays float32."""
    _, found, parameter = name.partition(".processor.")
    return bool(found) and parameter.split(".")[0] in FP32_PARAMETERS


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE: channel pairs ``(2i, 2i+1)`` of ``x`` ``(B, N, H, D)`` rotate by angle ``i``.

    ``cos``/``sin`` are Diffusers' tables ``(1, N, 1, D)`` with every angle repeated for both members
    of its pair.
    """
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[..., 0::2].to(x.dtype), sin[..., 0::2].to(x.dtype)
    return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``(..., D)`` over its last axis with ``weight`` ``(D,)``, in ``x``'s dtype.

    The mean square is accumulated in float32 (``vector_norm`` with a float32 result) without a float32
    copy of ``x``: two passes over ``x`` (read once for the norm, once to scale) instead of the five of
    an upcast ``F.rms_norm``. For half ``x`` the scale and the weight meet it rounded to its dtype.
    """
    accumulate = torch.promote_types(x.dtype, torch.float32)
    mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=accumulate).square() / x.shape[-1]
    scale = torch.rsqrt(mean_square + eps).to(x.dtype)
    out = x * scale
    return out.mul_(weight.to(x.dtype))


def rotary_rows(tables: tuple[torch.Tensor, torch.Tensor] | None, rows: slice) -> tuple[torch.Tensor, ...] | None:
    """Diffusers' shared RoPE tables ``(S, D)`` (every head alike) as the operator's ``(1, n, 1, D)``, for ``rows``."""
    if tables is None:
        return None
    return tuple(table[rows][None, :, None, :] for table in tables)


def joint_projections(attn: torch.nn.Module, x: torch.Tensor, added: bool = False) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` ``(B, S, H, D)`` of one stream of a joint-attention layer (HunyuanVideo, CogVideoX, Flux): the
    image stream's projections (``to_q``, ...; ``to_qkv`` once fused) or, with ``added``, the text stream's own
    (``add_q_proj``, ...; ``to_added_qkv``), each query and key through its per-head norm where the layer has one."""
    if added:
        fused, separate = "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")
        norms = ("norm_added_q", "norm_added_k")
    else:
        fused, separate, norms = "to_qkv", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k")
    if getattr(attn, "fused_projections", False) and getattr(attn, fused, None) is not None:
        q, k, v = getattr(attn, fused)(x).chunk(3, dim=-1)
    else:
        q, k, v = (getattr(attn, name)(x) for name in separate)
    q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
    norm_q, norm_k = (getattr(attn, name, None) for name in norms)
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


#: The refusal of context parallelism for causal MHLA layers (by :func:`enable_context_parallel` and the processors).
CAUSAL_CONTEXT_PARALLEL_ERROR = (
    "context parallelism has no block-causal MHLA (MHLAConfig(causal=True)): its all-reduced block summaries are "
    "bidirectional; run a causal model on one process per video, or convert it without causal"
)


class _InputInWeightDtype:
    """A layer that casts its input to its weight's dtype inside ``forward``: after Diffusers' layerwise-casting
    hook (``enable_layerwise_casting``) has cast a weight stored in e.g. float8 to the compute dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class LePEConv2d(_InputInWeightDtype, nn.Conv2d):
    """LePE's depthwise convolution over a DiT token grid."""


class LePEConv3d(_InputInWeightDtype, nn.Conv3d):
    """LePE's depthwise convolution over a Wan token grid."""


class MHLAProcessor(nn.Module):
    """Base of the Wan and DiT MHLA processors (one instance per layer)."""

    #: Grid axes of the model family (3 for video, 2 for images); set by subclasses.
    num_axes: int = 0
    #: Initialise LePE as the identity (centre tap 1) instead of PyTorch's default init.
    lepe_identity_init: bool = False
    #: Whether the layer attends over image and text tokens together: its mixing has one more row and column,
    #: the text block's (:mod:`~mhla_diffusion.ops.joint`).
    text_block: bool = False
    #: Whether the family runs block-causal MHLA (Wan's attention: Wan, SkyReels-V2).
    causal_support: bool = False
    #: Diffusers' ``enable_parallelism`` sets its ``ParallelConfig`` here (on every processor that has the
    #: attribute); with context parallelism each call then holds one process's tokens
    #: (:mod:`mhla_diffusion.ops.context_parallel`).
    _parallel_config = None
    #: The :class:`~mhla_diffusion.models.streaming.CausalStream` whose chunk is running (causal layers only).
    stream = None
    #: The :class:`~mhla_diffusion.models.teacher_forcing.TeacherForcing` in force (causal layers only).
    forcing = None

    def __init__(
        self,
        heads: int,
        head_dim: int,
        layout: tuple[int, ...],
        config: MHLAConfig,
        grid_context: TokenGridContext,
    ) -> None:
        super().__init__()
        if len(layout) != self.num_axes:
            raise ValueError(f"`layout` {layout} must have {self.num_axes} axes for {type(self).__name__}")
        self.heads, self.head_dim, self.layout = heads, head_dim, tuple(layout)
        self.normalization = config.normalization  # "denominator", "none" or "scalar_mixed_denominator"
        self.eps = config.eps
        self.output_dropout = config.output_dropout
        self.grid_context = grid_context
        inner = heads * head_dim

        self.causal = config.causal
        if config.causal and not self.causal_support:
            raise ValueError(
                f"`causal` MHLA runs forwards in time over the video frames of Wan's attention: {type(self).__name__} "
                "has no causal form; use it with a Wan or SkyReels-V2 model, or convert without causal"
            )
        if self.text_block:
            refused = [name for name, on in (("gate", config.gate), ("input_norm", config.input_norm)) if on]
            if refused or config.normalization == "scalar_mixed_denominator":
                what = ", ".join(refused) or "normalization='scalar_mixed_denominator'"
                raise ValueError(
                    f"joint text-image MHLA ({type(self).__name__}) has no {what}: those act on image tokens "
                    "alone, or need equal-size blocks; convert without them"
                )
        init = dict(
            normalization=config.mixing_normalization,
            exp_sigma=config.exp_sigma,
            local_threshold=config.local_threshold,
        )
        if config.causal:  # (K + 2, S, S): the offsets 0 .. K and the fold
            mixing = causal_mixing_init(layout[1:], config.causal_window, config.transform, **init)
        else:
            mixing = mixing_init(layout, config.transform, **init)
        if self.text_block:  # (M + 1, M + 1): the text block last
            mixing = joint_mixing_init(mixing)
        if config.per_head_mixing:
            mixing = mixing.expand(heads, *mixing.shape).clone()
        self.mixing = nn.Parameter(mixing, requires_grad=config.learnable_mixing)
        self.fold_decay_logit = None
        if config.causal and config.causal_fold == "decay":
            logit = math.log(CAUSAL_DECAY_INIT / (1 - CAUSAL_DECAY_INIT))
            self.fold_decay_logit = nn.Parameter(torch.full((heads,), logit), requires_grad=config.learnable_mixing)
        self.mean_fold = bool(config.causal and config.causal_fold == "mean")  # older rows averaged, not summed
        self.out_norm = nn.RMSNorm(head_dim, eps=1e-6) if config.output_norm else None
        self.gate = nn.Linear(inner, inner) if config.gate else None
        # affine starts as the identity (PyTorch's default init: weight 1, bias 0)
        self.input_norm = nn.LayerNorm(inner, eps=1e-5, elementwise_affine=True) if config.input_norm else None
        self.lepe = None
        if config.lepe:
            conv = LePEConv3d if self.num_axes == 3 else LePEConv2d
            self.lepe = conv(inner, inner, kernel_size=3, padding=1, groups=inner)
            if self.lepe_identity_init:
                with torch.no_grad():
                    self.lepe.weight.zero_()
                    self.lepe.weight[(slice(None), 0) + (1,) * self.num_axes] = 1.0
                    self.lepe.bias.zero_()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # Every cast (model.to(dtype), .bfloat16(), .half(), Diffusers' from_pretrained) comes through here:
        # FP32_PARAMETERS keep their float32 values and follow only the move to another device.
        kept = {
            name: param.data
            for name, param in self.named_parameters()
            if name.split(".")[0] in FP32_PARAMETERS and param.dtype not in HALF_DTYPES
        }
        super()._apply(fn, recurse)
        for name, param in self.named_parameters():
            if name.split(".")[0] in FP32_PARAMETERS and param.dtype in HALF_DTYPES:
                original = kept.get(name)
                param.data = param.data.float() if original is None else original.to(device=param.device)
        return self

    def _teacher_forced(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        clip: tuple[int, ...],
        layout: tuple[int, ...],
        features: dict[str, Any],
    ) -> torch.Tensor:
        """Causal MHLA of a ``[clean | noisy]`` input ``(B, 2N, H, D)``, each copy on the token grid ``clip``: the
        clean copy block-causally, the noisy copy chunk by chunk against the clean copy's earlier chunks."""
        n, rotary = q.shape[1] // 2, features["rotary"]
        if rotary is not None:  # both copies sit at the same positions: the clean copy's tables serve both
            features = {**features, "rotary": tuple(t[:, :n] for t in rotary)}
        options = {**self.fold_options, **features}
        clean = (q[:, :n], k[:, :n], v[:, :n])
        out_clean = mhla_causal_attention(*clean, clip, layout, self.mixing, **options)
        rows = self.forcing.chunk_rows
        out_noisy = mhla_causal_teacher_forcing(
            q[:, n:], k[:, n:], v[:, n:], clean[1], clean[2], clip, layout, self.mixing, rows, **options
        )
        return torch.cat([out_clean, out_noisy], dim=1)

    def causal_layout(self, grid: tuple[int, ...]) -> tuple[int, ...]:
        """The block layout of a causal layer on ``grid``: one temporal block row per latent frame, the layout's
        spatial blocks within each (its first axis is not used), so rows are the same in a chunk and a whole clip."""
        return (grid[0], *self.layout[1:])

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.layout)

    @property
    def feature_offset(self) -> float:
        """The feature map's offset: ``φ(x) = ReLU(x) + feature_offset`` (the config's ``eps``)."""
        return self.eps

    @property
    def fold_decay(self) -> torch.Tensor | None:
        """The causal fold's decay per head ``(H,)`` in ``(0, 1)``; ``None`` when older rows are summed."""
        return None if self.fold_decay_logit is None else torch.sigmoid(self.fold_decay_logit)

    @property
    def fold_options(self) -> dict[str, Any]:
        """How the causal operators fold the rows older than the window: ``decay`` and ``mean_fold``."""
        return {"decay": self.fold_decay, "mean_fold": self.mean_fold}

    @property
    def normalize(self) -> bool:
        """Whether the output is divided by a denominator (either kind)."""
        return self.normalization != "none"

    def extra_repr(self) -> str:
        mode = {"none": "no denominator"}.get(self.normalization, self.normalization)
        dropout = f", output dropout {self.output_dropout}" if self.output_dropout else ""
        causal = ""
        if self.causal:
            fold = "mean" if self.mean_fold else "sum" if self.fold_decay_logit is None else "decay"
            causal = f", causal (window {self.mixing.shape[-3] - 2}, {fold} fold)"
        return (
            f"heads={self.heads}, head_dim={self.head_dim}, layout={self.layout}, blocks={self.num_blocks}, "
            f"{mode}{dropout}{causal}"
        )

    def normalize_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The attention's input through ``input_norm`` (if any), before the q/k/v projections."""
        if self.input_norm is None:
            return hidden_states
        norm = self.input_norm  # in at least float32, as the output RMSNorm
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        out = F.layer_norm(
            hidden_states.to(compute), norm.normalized_shape, norm.weight.to(compute), norm.bias.to(compute), norm.eps
        )
        return out.to(hidden_states.dtype)

    def drop_output(self, out: torch.Tensor) -> torch.Tensor:
        """Dropout of the projected output (``output_dropout``), in training mode only."""
        if not self.output_dropout:
            return out
        return F.dropout(out, self.output_dropout, training=self.training)

    def attend(
        self,
        layer_input: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """MHLA of projected ``q, k, v`` ``(B, N, H, D)`` plus the optional extras -> ``(B, N, H*D)``.

        ``layer_input`` ``(B, N, C)`` is what produced ``q, k, v`` (after ``input_norm``); the gate reads it.
        Under context parallelism (``_parallel_config`` set) ``N`` is this process's share of the sequence.

        A causal layer (``MHLAConfig.causal``) runs :func:`~mhla_diffusion.ops.causal.mhla_causal_attention`
        over a whole clip on the eager operator (training), or, inside a stream's chunk,
        :func:`~mhla_diffusion.ops.causal.mhla_causal_step`, on the fused kernels where they are available
        (:mod:`~mhla_diffusion.ops.fused_causal`). Context parallelism has no causal form and is refused.
        """
        shard = self._context_shard(q.shape[1])  # None: this process holds every token
        if self.causal and shard is not None:
            raise ValueError(CAUSAL_CONTEXT_PARALLEL_ERROR)
        grid = self.grid_context.require(q.shape[1] if shard is None else shard.total)
        forced = self.causal and self.forcing is not None  # [clean | noisy] copies (models/teacher_forcing.py)
        clip = (grid[0] // 2, *grid[1:]) if forced else grid  # the grid each copy's attention runs on
        layout = self.causal_layout(clip) if self.causal else self.layout
        plan = self.grid_context.plan(layout, q.device, clip)  # built (and checked) once per transformer forward
        if self.normalization == "scalar_mixed_denominator" and plan.valid is not None:  # uneven or empty blocks
            check_equal_blocks(grid, self.layout, "this forward's token grid (latent size // patch size)")
        # the operator applies the feature map ReLU(x) + eps and RoPE (after it, numerator only) itself
        features = dict(
            normalize=self.normalization, eps=self.eps, plan=plan, feature_eps=self.feature_offset, rotary=rotary_emb
        )
        if forced:
            out = self._teacher_forced(q, k, v, clip, layout, features)
        elif self.causal and self.stream is not None:  # one chunk of a stream (models/streaming.py)
            stream = self.stream  # a denoising forward only reads the carried state; advancing builds the next
            state = stream.state(self)
            out, state = mhla_causal_step(
                q, k, v, grid, layout, self.mixing, state, advance=stream.advancing, state_dtype=stream.state_dtype,
                fused=fused_available(q), **self.fold_options, **features,
            )  # fmt: skip
            stream.stage(self, state)
        elif self.causal:  # a whole clip (training): eager, differentiable
            out = mhla_causal_attention(q, k, v, grid, layout, self.mixing, **self.fold_options, **features)
        elif shard is None and self.normalization != "scalar_mixed_denominator" and fused_available(q):
            out = mhla_attention_fused(  # Triton on CUDA (MHLA_FUSED=0 turns it off): one read of q, k, v
                q,
                k,
                v,
                plan,
                self.mixing,
                cos=None if rotary_emb is None else rotary_emb[0],
                sin=None if rotary_emb is None else rotary_emb[1],
                feature_eps=self.feature_offset,
                normalize=self.normalization,
                eps=self.eps,
            )
        elif shard is None:
            out = mhla_attention(q, k, v, grid, self.layout, self.mixing, **features)
        else:  # partial block summaries, one all-reduce over the context-parallel group, local queries
            local_plan = self.grid_context.local_plan(self.layout, q.device, shard.start, shard.stop)
            out = mhla_attention_context_parallel(
                q, k, v, grid, self.layout, self.mixing, shard, local_plan=local_plan, **features
            )
        return self.extras(out, layer_input, v, grid, shard)

    def extras(
        self,
        out: torch.Tensor,
        layer_input: torch.Tensor | None,
        v: torch.Tensor,
        grid: tuple[int, ...],
        shard: TokenShard | None = None,
    ) -> torch.Tensor:
        """The attention output ``(B, N, H, Dv)`` through the optional output RMSNorm, gate and LePE ->
        ``(B, N, H*Dv)``."""
        if self.out_norm is not None:
            out = head_rms_norm(out.to(v.dtype), self.out_norm.weight, self.out_norm.eps)
        out = out.flatten(2)
        if self.gate is not None:
            out = out * F.silu(self.gate(layer_input))
        if self.lepe is not None:
            out = out + self._lepe(v.flatten(2), grid, shard)
        return out

    def attend_features(
        self,
        layer_input: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_rot: torch.Tensor | None = None,
        k_rot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MHLA of feature-mapped ``q, k`` ``(B, N, H, D)`` whose numerator's RoPE the family applied itself
        (``q_rot``, ``k_rot``; LTX-Video rotates across the whole inner dim), plus the extras -> ``(B, N, H*D)``."""
        grid, plan = self._whole_grid(q)
        out = mhla_attention(
            q, k, v, grid, self.layout, self.mixing, q_rot=q_rot, k_rot=k_rot, normalize=self.normalization,
            eps=self.eps, plan=plan,
        )  # fmt: skip
        return self.extras(out, layer_input, v, grid)

    def attend_joint(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        text_q: torch.Tensor,
        text_k: torch.Tensor,
        text_v: torch.Tensor,
        text_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint MHLA (:func:`~mhla_diffusion.ops.joint.mhla_joint_attention`) of the image tokens' projections ``q, k,
        v`` ``(B, N, H, D)`` and the text tokens' ``(B, L, H, D)``; ``rotary_emb``: the image tokens' RoPE tables
        ``(cos, sin)``, ``(1, N, 1, D)``. Returns ``(image (B, N, H*D), text (B, L, H*D))`` after the output RMSNorm
        (both) and LePE (image)."""
        grid, plan = self._whole_grid(q)
        image, text = mhla_joint_attention(
            q, k, v, text_q, text_k, text_v, grid, self.layout, self.mixing, text_mask=text_mask,
            normalize=self.normalization, eps=self.eps, plan=plan, feature_eps=self.feature_offset, rotary=rotary_emb,
        )  # fmt: skip
        if self.out_norm is not None:
            text = head_rms_norm(text.to(text_v.dtype), self.out_norm.weight, self.out_norm.eps)
        return self.extras(image, None, v, grid), text.flatten(2)

    def _whole_grid(self, q: torch.Tensor) -> tuple[tuple[int, ...], BlockPlan]:
        """The grid and block plan of a call that sees every image token ``q`` ``(B, N, H, D)``: the families
        without a context-parallel form refuse a split sequence."""
        if self._parallel_config is not None:
            raise ValueError(
                f"{type(self).__name__} has no context-parallel form (Wan and DiT have one): run it on one process"
            )
        return self.grid_context.require(q.shape[1]), self.grid_context.plan(self.layout, q.device)

    def _context_shard(self, num_tokens: int) -> TokenShard | None:
        """This process's share of the sequence under context parallelism (``None`` without), checked
        against the ``num_tokens`` this call got."""
        if self._parallel_config is None:
            return None
        total = self.grid_context.require_total()
        shard = TokenShard.from_parallel_config(self._parallel_config, total)
        if shard is not None and shard.num_local != num_tokens:
            raise RuntimeError(
                f"context-parallel MHLA on rank {shard.rank} of {shard.world_size}: "
                f"expected tokens {shard.start}..{shard.stop - 1} "
                f"({shard.num_local}) of the {total}-token grid {self.grid_context.grid} but got {num_tokens}; the "
                "sequence must be split by Diffusers' context-parallel hooks (enable_context_parallel), in rank order"
            )
        return shard

    def _lepe(self, v: torch.Tensor, grid: tuple[int, ...], shard: TokenShard | None = None) -> torch.Tensor:
        """Depthwise conv of ``v`` ``(B, N, C)`` laid out on the token grid, back to ``(B, N, C)``; with a
        ``shard``, of this process's ``N_local`` tokens, neighbours across its range's edges fetched from
        the processes that hold them."""
        if shard is not None:
            return grid_conv_context_parallel(self.lepe, v, grid, shard).to(v.dtype)
        batch, n, channels = v.shape
        image = v.transpose(1, 2).reshape(batch, channels, *grid)
        return self.lepe(image).reshape(batch, channels, n).transpose(1, 2).to(v.dtype)
