"""``MHLAConfig``: the one object that holds every MHLA option (torch-free: the trainers check it before loading
torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from .utils.choices import CAUSAL_FOLDS, MIXING_TRANSFORMS
from .utils.geometry import check_equal_blocks

__all__ = ["MHLAConfig", "NORMALIZATIONS"]

LayerSpec = Literal["all", "hybrid"] | Sequence[int]

#: The ``normalization`` choices: the paper's denominator, none (released Wan-MHLA), and the released
#: DiT-MHLA (``MHLA4DiT``) denominator that mixes per-block scalars.
NORMALIZATIONS = ("denominator", "none", "scalar_mixed_denominator")


@dataclass
class MHLAConfig:
    """Options for :func:`convert_to_mhla`.

    Attributes:
        layers: which transformer blocks get MHLA self-attention: ``"all"``, ``"hybrid"`` (the
            reference's 2/3 pattern: every block whose index ``i % 3 != 0``) or a list of indices.
        layout: blocks per token-grid axis (Wan: frames, height, width; DiT: rows, columns), or
            ``"auto"`` (default): chosen once at conversion for the token grid of ``target_grid`` (below)
            with ``M <= sqrt(N)`` (with ``scalar_mixed_denominator`` only among layouts that divide that
            grid). The layout stays fixed afterwards (the mixing weights are ``M x M``); other grids reuse
            it through the uneven-block rule (not with ``scalar_mixed_denominator``, which refuses a grid
            the layout does not divide).
        target_grid: token grid the ``auto`` layout is chosen for (and an explicit layout is checked
            against). ``None`` (default): the model family's default grid, from its row in
            :data:`~mhla_diffusion.models.families.FAMILIES` (``ModelFamily.default_grid``), so
            ``MHLAConfig()`` converts every family:

            * Wan (2.1 and 2.2): the grid of Wan2.1's published default video, 81x480x832, under the
              transformer's own patch size and Wan2.1's VAE factors (x4 in time, x8 in space; a transformer
              does not record its VAE): (21, 30, 52) for patch 1x2x2 (every published Wan transformer),
              giving layout 3x5x9. Give the grid of the size you will generate where it differs, e.g.
              Wan2.2-TI2V-5B (x16 VAE) at 121x704x1280: ``video_token_grid(121, 704, 1280,
              vae_scale=(4, 16, 16))`` -> (31, 22, 40).
            * DiT: its config's ``sample_size // patch_size`` square, which the model is made for
              (DiT-XL/2 at 256 px: (16, 16), layout 4x4).

            The grid and layout chosen are logged (INFO) and recorded on the returned
            :class:`~mhla_diffusion.models.conversion.MHLAConversion` (``grid``, ``grid_origin``, ``layout``).
        transform: mixing initialisation: ``linear``, ``cos``, ``exp``, ``gaussian`` or ``local``.
        mixing_normalization: ``column`` (reference code: global max distance, columns sum to 1) or
            ``row`` (paper: per-row max distance, rows sum to 1).
        exp_sigma, local_threshold: parameters of the ``exp`` and ``local`` transforms.
        per_head_mixing: one ``(M, M)`` matrix per attention head instead of one shared by all heads.
        learnable_mixing: train the mixing coefficients (the reference does).
        normalization: ``denominator`` (the paper's ``q_t · z̃_b(t) + eps``), ``none`` (released
            Wan-MHLA) or ``scalar_mixed_denominator`` (released DiT-MHLA, ``MHLA4DiT``): the token at
            within-block position ``w`` of block ``o`` is divided by ``Σ_j W[o, j] (q_(j,w) · z_j) + eps``,
            which mixes the scalars ``q · z_j`` computed with the query at the same position ``w`` in
            each block ``j``; it needs a layout that divides the token grid (equal-size blocks).
        output_norm: per-head RMSNorm of the attention output (one weight of size head_dim, eps 1e-6),
            as in released Wan-MHLA.
        gate: multiply the output by ``SiLU(Linear(x))`` of the layer input.
        lepe: add a depthwise 3x3 (DiT) / 3x3x3 (Wan) convolution of ``v`` over the token grid.
        eps: feature-map offset (``ReLU(x) + eps``) and denominator epsilon.
        input_norm: a ``LayerNorm(C, eps=1e-5)`` with affine parameters on the attention's input, before
            the q/k/v projections, inside the attention (processor submodule ``input_norm``), as
            released DiT-MHLA. Its affine starts as the identity (weight 1, bias 0), but the
            normalisation itself still changes the input, so a converted pretrained model's output
            changes until fine-tuned.
        output_dropout: dropout probability on the attention output after the output projection,
            active only in training mode (released DiT-MHLA: 0.1).
        causal: block-causal MHLA (Wan video only): every latent frame is one temporal block row, cut
            by the layout's spatial axes into ``S`` blocks (the layout's first, frame axis is not used);
            a query block mixes only the key blocks of its own frame and of earlier frames, with weights
            that depend on the temporal offset, so video can be generated chunk by chunk with a state of
            constant size (:mod:`mhla_diffusion.ops.causal`, :mod:`mhla_diffusion.models.streaming`). The
            mixing is then ``(K + 2, S, S)`` (per head ``(H, K + 2, S, S)``), initialised by ``transform``
            as the plain one.
            Not with ``scalar_mixed_denominator`` nor ``lepe`` (whose convolution reads the next frame).
        causal_window: ``K``, how many earlier temporal block rows are mixed one by one, each offset
            ``0 .. K`` with its own ``S x S`` matrix; older rows are folded into one summary per spatial
            block with one more matrix. A stream carries ``K + 1`` rows of block summaries per layer.
        causal_fold: how the rows older than the window are folded: ``sum``, ``decay`` (each row of age
            multiplied by a learnable factor in ``(0, 1)`` per head), or ``mean`` (averaged: the fold's scale stays
            the same however long the video, where a sum grows with it).
    """

    layers: LayerSpec = "all"
    layout: Sequence[int] | Literal["auto"] = "auto"
    target_grid: Sequence[int] | None = None
    transform: str = "linear"
    mixing_normalization: Literal["column", "row"] = "column"
    exp_sigma: float = 3.0
    local_threshold: float = 1.5
    per_head_mixing: bool = False
    learnable_mixing: bool = True
    normalization: Literal["denominator", "none", "scalar_mixed_denominator"] = "denominator"
    output_norm: bool = False
    gate: bool = False
    lepe: bool = False
    eps: float = 1e-6
    input_norm: bool = False
    output_dropout: float = 0.0
    causal: bool = False
    causal_window: int = 2
    causal_fold: Literal["sum", "decay", "mean"] = "sum"

    def __post_init__(self) -> None:
        if isinstance(self.layers, str):
            if self.layers not in ("all", "hybrid"):
                raise ValueError(f"`layers` must be 'all', 'hybrid' or a list of block indices, got {self.layers!r}")
        else:
            try:
                self.layers = sorted({int(i) for i in self.layers})
            except (TypeError, ValueError):
                raise ValueError(
                    f"`layers` must be 'all', 'hybrid' or a list of block indices, got {self.layers!r}"
                ) from None
            if not self.layers or self.layers[0] < 0:
                raise ValueError(f"`layers` must list at least one non-negative block index, got {self.layers}")
        if isinstance(self.layout, str):
            if self.layout != "auto":
                raise ValueError(f"`layout` must be 'auto' or blocks per axis such as (3, 5, 10), got {self.layout!r}")
        else:
            self.layout = _positive_ints("layout", self.layout)
        if self.target_grid is not None:
            self.target_grid = _positive_ints("target_grid", self.target_grid)
        if self.transform not in MIXING_TRANSFORMS:
            raise ValueError(f"unknown `transform` {self.transform!r}: choose one of {', '.join(MIXING_TRANSFORMS)}")
        if self.mixing_normalization not in ("column", "row"):
            raise ValueError(f"`mixing_normalization` must be 'column' or 'row', got {self.mixing_normalization!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"`normalization` must be one of {', '.join(map(repr, NORMALIZATIONS))}, got {self.normalization!r}"
            )
        if not isinstance(self.input_norm, bool):
            raise ValueError(f"`input_norm` must be True or False, got {self.input_norm!r}")
        if (
            isinstance(self.output_dropout, bool)
            or not isinstance(self.output_dropout, (int, float))
            or not 0 <= self.output_dropout < 1
        ):
            raise ValueError(f"`output_dropout` must be a probability in [0, 1), got {self.output_dropout!r}")
        self.output_dropout = float(self.output_dropout)
        if self.normalization == "scalar_mixed_denominator" and self.target_grid is not None and self.layout != "auto":
            check_equal_blocks(self.target_grid, self.layout, "`target_grid`")
        if not self.eps > 0:
            raise ValueError(f"`eps` must be > 0, got {self.eps}")
        if not self.exp_sigma > 0:
            raise ValueError(f"`exp_sigma` must be > 0, got {self.exp_sigma}")
        self._check_causal()

    def _check_causal(self) -> None:
        if not isinstance(self.causal, bool):
            raise ValueError(f"`causal` must be True or False, got {self.causal!r}")
        if isinstance(self.causal_window, bool) or not isinstance(self.causal_window, int) or self.causal_window < 0:
            raise ValueError(
                f"`causal_window` must be an int >= 0 (earlier temporal block rows mixed one by one), "
                f"got {self.causal_window!r}"
            )
        if self.causal_fold not in CAUSAL_FOLDS:
            raise ValueError(
                f"`causal_fold` must be one of {', '.join(map(repr, CAUSAL_FOLDS))}, got {self.causal_fold!r}"
            )
        if self.causal and self.lepe:
            raise ValueError(
                "`causal` MHLA cannot take `lepe`: its 3x3x3 convolution of v reads the next frame; "
                "convert with lepe=False"
            )
        if self.causal and self.normalization == "scalar_mixed_denominator":
            raise ValueError(
                "`causal` MHLA has no 'scalar_mixed_denominator' normalization (it needs the queries of every key "
                "block, which a stream does not keep): use normalization='denominator' or 'none'"
            )

    @classmethod
    def released_wan(cls, gate: bool = True, **overrides: Any) -> "MHLAConfig":
        """The released Wan-MHLA setting: no denominator, per-head output RMSNorm, SiLU gate,
        3x5x10 blocks on the 21x30x50 grid of 81x480x800 video. The released training scripts
        drop the gate by mistake; pass ``gate=False`` to match checkpoints trained that way."""
        options: dict[str, Any] = dict(layout=(3, 5, 10), normalization="none", output_norm=True, gate=gate)
        options.update(overrides)
        return cls(**options)

    @classmethod
    def released_dit(cls, **overrides: Any) -> "MHLAConfig":
        """The released DiT-MHLA setting (``MHLA4DiT``): input LayerNorm inside the attention, the
        scalar-mixed denominator, LePE 3x3 on ``v`` (identity init), output dropout 0.1, every block,
        linear column-normalised learnable mixing, ``ReLU + eps`` features.

        The released models use 16-token (4x4) blocks; ``layout="auto"`` with this normalisation picks
        among layouts that divide the model's token grid, which is 4x4 blocks on DiT-XL/2's 16x16
        grid at 256 px. Pass ``layout=(4, 4)`` (or ``target_grid``) to fix it for other sizes.
        """
        options: dict[str, Any] = dict(
            layers="all",
            layout="auto",
            transform="linear",
            mixing_normalization="column",
            learnable_mixing=True,
            normalization="scalar_mixed_denominator",
            input_norm=True,
            lepe=True,
            output_dropout=0.1,
        )
        options.update(overrides)
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("layers", "layout", "target_grid"):
            if isinstance(out[key], tuple):
                out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MHLAConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown MHLAConfig keys {unknown}; known keys: {sorted(names)}")
        return cls(**data)


def _positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a sequence of positive ints, got {values!r}") from None
    if not 1 <= len(out) <= 3 or any(v < 1 for v in out):
        raise ValueError(f"`{name}` must have 1 to 3 positive entries, got {values!r}")
    return out
