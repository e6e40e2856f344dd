"""Choice lists several parts of the package accept alike (the CLI, the trainers, the web demo, the loaders).

Torch-free, so ``mhla --help`` can list them without loading torch.
"""

from __future__ import annotations

import typing
from typing import Literal

__all__ = ["ATTENTIONS", "Attention", "CAUSAL_FOLDS", "MIXING_TRANSFORMS", "WEIGHT_DTYPES"]

#: The self-attention a model runs: its MHLA layers, or the original softmax attention with the same weights.
Attention = Literal["mhla", "softmax"]
#: The values of :data:`Attention`, in the order help texts list them.
ATTENTIONS: tuple[str, ...] = typing.get_args(Attention)
#: Weights dtypes a user may ask for by name.
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
#: The mixing initialisations of :class:`~mhla_diffusion.MHLAConfig` (``transform``; see
#: :func:`~mhla_diffusion.ops.mixing.mixing_init`).
MIXING_TRANSFORMS = ("linear", "cos", "exp", "gaussian", "local")
#: How causal MHLA folds the temporal block rows older than its window (``causal_fold`` of
#: :class:`~mhla_diffusion.MHLAConfig`; see :mod:`mhla_diffusion.ops.causal`): summed, each row of age
#: multiplied by a learnable decay, or averaged (a fold whose scale does not grow with the video).
CAUSAL_FOLDS = ("sum", "decay", "mean")
