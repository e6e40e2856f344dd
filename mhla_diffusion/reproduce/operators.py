"""Part A of ``mhla reproduce``: one attention layer fitted to a fixed teacher on a 2-D token grid, and
the rank of the N x N attention matrix it learned (and had before training).

Tasks (:data:`TASKS`), each on a ``side`` x ``side`` grid of ``N = side**2`` tokens:

* ``local``: a fixed softmax attention whose logits add a sharp positional bias
  ``-|p_i - p_j|**2 / (2 LOCAL_WIDTH**2)`` (grid units) to its content term; the teacher's output on
  Gaussian token contents is the target, scored by the relative error ``|y_hat - y| / |y|`` on held-out
  inputs. The width is fixed in tokens, so the teacher grows more local relative to the grid as N grows.
* ``groups``: a teacher that is not local and whose attention matrix has a known rank. Every token carries
  one of ``groups`` tags (one-hot, each tag on ``N / groups`` tokens, rounded, at random places in the grid)
  beside Gaussian contents; the teacher outputs, for each token, the mean over the tokens of its tag of
  ``content @ W``. Its attention matrix ``A[i, j] = 1[tag_i = tag_j] / |tag_i|`` has rank exactly ``groups``
  (:meth:`Task.teacher_matrix`), 64 by default: twice a head's ``d = 32``. Scored like ``local``.
* ``recall``: associative recall. ``pairs`` tokens anywhere in the grid each hold a (key, value) pair (keys
  drawn without repetition from ``keys``, values from :data:`RECALL_VALUES`), ``pairs`` other tokens each
  hold one of those keys as a query, the rest are filler; every query token must output its key's value.
  With 64 pairs and ``d = 32`` a rank-``d`` state cannot hold them all. Scored by the recall accuracy on
  held-out grids.

Every student sees the token contents concatenated with fixed 2-D sinusoidal position features
(:func:`position_features`), and is one attention layer (``heads`` x ``head_dim``) between linear maps
(:class:`AttentionStudent`, kinds in :data:`STUDENTS`, described in :data:`STUDENT_KINDS`). The linear
kinds are the MHLA operator with the same feature map ``ReLU(x) + eps``; they differ only in their blocks,
their mixing and whether it learns, and one adds LePE. Every draw depends on ``(seed, step)`` only, so the
students of one seed see the same batches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention import mhla_attention
from ..ops.block_layout import block_plan, num_blocks
from ..ops.mixing import mixing_init
from ..training.loop import step_generator

__all__ = [
    "STUDENTS",
    "STUDENT_KINDS",
    "TASKS",
    "AttentionStudent",
    "Task",
    "attention_measures",
    "block_layout",
    "check_task_tokens",
    "choose_rates",
    "mhla_layout",
    "mhla_rank_bound",
    "rank_bound",
    "shuffled_mixing",
    "token_permutation",
    "train_students",
]

#: Student kind -> what it is. Frozen mixing is a buffer (not trained); learned mixing a parameter.
STUDENT_KINDS = {
    "linear": "global linear attention (the operator with one block)",
    "linear-lepe": "global linear attention plus LePE (a depthwise 3x3 convolution of the values over the grid)",
    "mhla-uniform": "MHLA blocks with uniform mixing, frozen: every query block sees the same mix of all block "
    "summaries, so it computes global linear attention (up to the denominator's eps)",
    "mhla-shuffled": "MHLA blocks with the locality-initialised weights given to randomly permuted key blocks, "
    "frozen: blocks and the same weights, no locality",
    "mhla-frozen": "MHLA with locality-initialised mixing, frozen",
    "mhla": "MHLA with locality-initialised mixing, learned",
    "mhla-permuted": "MHLA (locality-initialised mixing, learned) on the tokens in a fixed random order: the same "
    "number and size of blocks and the same learned mixing, each block a random set of tokens, so the blocks "
    "add rank without spatial meaning",
    "linear-wide": "global linear attention whose query and key heads are as wide as MHLA's rank bound (values "
    "stay d wide): rank without blocks",
    "mhla-lepe": "MHLA (locality-initialised mixing, learned) plus LePE",
    "mhla-per-head": "MHLA with one learned locality-initialised mixing matrix per head",
    "softmax": "softmax attention",
}
STUDENTS = tuple(STUDENT_KINDS)
TASKS = ("local", "groups", "recall")
CONTENT_DIM = 32  # the local and groups tasks' token contents and output
POSITION_FREQUENCIES = 8  # per axis and per sin / cos: 32 position features
LOCAL_WIDTH = 1.5  # the local teacher's positional bias width, in tokens
GROUPS = 64  # the groups teacher's tags: the rank of its attention matrix
RECALL_KEYS, RECALL_VALUES, RECALL_PAIRS = 128, 16, 64
TEACHER_SEED, EVAL_SEED, SHUFFLE_SEED, PERMUTE_SEED = 1234, 5678, 4321, 8765
FEATURE_EPS = 1e-6
RANK_TOLERANCES = (1e-3, 1e-2)  # numerical rank: singular values above this fraction of the largest


def mhla_layout(side: int) -> tuple[int, int]:
    """``k`` x ``k`` blocks on a ``side`` x ``side`` grid: the largest power of two ``k`` dividing ``side``
    with ``M = k * k <= sqrt(N)`` (the paper's rule): 2x2 at 64 tokens, 4x4 at 256 and 1,024, 8x8 at 4,096."""
    k = 1
    while side % (2 * k) == 0 and (2 * k) ** 2 <= side:
        k *= 2
    return (k, k)


def block_layout(side: int, block_side: int | None) -> tuple[int, int]:
    """The block layout on a ``side`` x ``side`` grid: blocks of ``block_side`` x ``block_side`` tokens, so
    the block size stays the same across grids (``None``: :func:`mhla_layout`'s rule, whose blocks grow with
    the grid). Raises naming both sizes when the block side does not divide the grid side."""
    if block_side is None:
        return mhla_layout(side)
    if block_side < 1 or side % block_side:
        raise ValueError(
            f"blocks of {block_side}x{block_side} tokens do not tile a {side}x{side} grid; choose a block side "
            f"that divides {side}"
        )
    return (side // block_side, side // block_side)


def grid_side(tokens: int) -> int:
    """The side of a square grid of ``tokens`` tokens; raises naming the token count otherwise."""
    side = math.isqrt(tokens)
    if side * side != tokens or side < 4:
        raise ValueError(f"token count {tokens} is not a square grid of at least 4x4 (64, 256, 1024, 4096, ...)")
    return side


def position_features(side: int) -> torch.Tensor:
    """``(N, 4 POSITION_FREQUENCIES)`` sin / cos of both grid coordinates at periods from 3 to 96 tokens."""
    coords = torch.arange(side, dtype=torch.float32)
    periods = 3.0 * 2.0 ** (torch.arange(POSITION_FREQUENCIES, dtype=torch.float32) * 5 / (POSITION_FREQUENCIES - 1))
    angles = 2 * math.pi * coords[:, None] / periods  # (side, F)
    axis = torch.cat([angles.sin(), angles.cos()], dim=1)  # (side, 2F)
    return torch.cat(
        [axis[:, None, :].expand(side, side, -1), axis[None, :, :].expand(side, side, -1)], dim=-1
    ).reshape(side * side, -1)


@dataclass
class Batch:
    """Student inputs ``x`` ``(B, N, C)``, targets, and for recall the query-token mask ``(B, N)``."""

    x: torch.Tensor
    target: torch.Tensor
    mask: torch.Tensor | None = None


def check_task_tokens(name: str, tokens: int, groups: int = GROUPS, pairs: int = RECALL_PAIRS) -> None:
    """Raise ``ValueError`` naming the task and a fix when ``tokens`` cannot hold it: a square grid of at
    least 4 x 4; ``groups`` needs two tokens per tag, ``recall`` a token for each pair and each query."""
    grid_side(tokens)
    if name == "groups" and tokens < 2 * groups:
        raise ValueError(
            f"groups task: {tokens} tokens give fewer than two tokens to each of {groups} tags; use more tokens"
        )
    if name == "recall" and tokens < 2 * pairs:
        raise ValueError(f"recall task: {tokens} tokens cannot hold {pairs} pairs and their queries; use more tokens")


class Task:
    """One teacher at one grid size: draws batches (a pure function of the generator) and scores students.
    ``groups`` (tags of the groups teacher, its rank), ``pairs`` and ``keys`` (recall) size the tasks;
    ``block_side`` sets the MHLA students' blocks (:func:`block_layout`); ``teacher_seed`` draws the local and
    groups teachers' weights (the experiment draws one per seed)."""

    def __init__(
        self,
        name: str,
        tokens: int,
        heads: int,
        head_dim: int,
        *,
        groups: int = GROUPS,
        pairs: int = RECALL_PAIRS,
        keys: int = RECALL_KEYS,
        block_side: int | None = None,
        teacher_seed: int = TEACHER_SEED,
    ) -> None:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}: choose from {', '.join(TASKS)}")
        if keys < pairs:
            raise ValueError(f"recall needs at least as many keys as pairs, got {keys} keys for {pairs} pairs")
        check_task_tokens(name, tokens, groups, pairs)
        self.name, self.tokens, self.side = name, tokens, grid_side(tokens)
        self.groups, self.pairs, self.keys = groups, pairs, keys
        self.positions = position_features(self.side)
        self.heads, self.head_dim = heads, head_dim
        self.layout = block_layout(self.side, block_side)  # the MHLA students' blocks
        g = torch.Generator().manual_seed(teacher_seed)
        if name == "local":
            scale = CONTENT_DIM**-0.5
            self.teacher = {w: torch.randn(CONTENT_DIM, heads * head_dim, generator=g) * scale for w in "qkv"}
            self.teacher["o"] = torch.randn(heads * head_dim, CONTENT_DIM, generator=g) * (heads * head_dim) ** -0.5
            coords = torch.cartesian_prod(torch.arange(self.side), torch.arange(self.side)).float()
            self.bias = -(torch.cdist(coords, coords) ** 2) / (2 * LOCAL_WIDTH**2)
        elif name == "groups":
            self.teacher = {"v": torch.randn(CONTENT_DIM, CONTENT_DIM, generator=g) * CONTENT_DIM**-0.5}

    @property
    def in_dim(self) -> int:
        extra = {
            "local": CONTENT_DIM,
            "groups": CONTENT_DIM + self.groups,
            "recall": 3 + self.keys + RECALL_VALUES,
        }[self.name]
        return extra + self.positions.shape[1]

    @property
    def out_dim(self) -> int:
        return RECALL_VALUES if self.name == "recall" else CONTENT_DIM

    @property
    def chance_loss(self) -> float | None:
        """The loss of a student that answers at chance, where the task has one (recall: ``ln`` of the number of
        values, the cross-entropy of a uniform guess)."""
        return math.log(RECALL_VALUES) if self.name == "recall" else None

    @property
    def teacher_rank(self) -> int | None:
        """The rank of the teacher's attention matrix where it is known by construction (``groups``)."""
        return self.groups if self.name == "groups" else None

    def batch(self, size: int, generator: torch.Generator) -> Batch:
        """``size`` fresh inputs and their targets."""
        return {"local": self._local, "groups": self._groups, "recall": self._recall}[self.name](size, generator)

    def _with_positions(self, content: torch.Tensor) -> torch.Tensor:
        return torch.cat([content, self.positions.expand(len(content), -1, -1)], dim=-1)

    def local_teacher(self, content: torch.Tensor) -> torch.Tensor:
        """The local teacher's output ``(B, N, CONTENT_DIM)`` for token contents ``(B, N, CONTENT_DIM)``."""
        q, k, v = (_split_heads(content @ self.teacher[w], self.heads) for w in "qkv")
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)  # content term scaled by 1/sqrt(d)
        return _merge_heads(out) @ self.teacher["o"]

    def _local(self, size: int, generator: torch.Generator) -> Batch:
        content = torch.randn(size, self.tokens, CONTENT_DIM, generator=generator)
        return Batch(self._with_positions(content), self.local_teacher(content))

    def group_tags(self, size: int, generator: torch.Generator) -> torch.Tensor:
        """``(size, N)`` tags: tag ``t`` on the tokens ``i`` with ``i mod groups == t`` of a random permutation,
        so every tag is present, on ``floor`` or ``ceil`` of ``N / groups`` tokens scattered over the grid."""
        base = torch.arange(self.tokens) % self.groups
        return torch.stack([base[torch.randperm(self.tokens, generator=generator)] for _ in range(size)])

    def groups_teacher(self, content: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        """The groups teacher's output ``(B, N, CONTENT_DIM)``: per token, the mean of ``content @ W`` over the
        tokens of its tag (``content`` ``(B, N, CONTENT_DIM)``, ``tags`` ``(B, N)``)."""
        index = tags[..., None].expand(-1, -1, CONTENT_DIM)
        sums = torch.zeros(len(content), self.groups, CONTENT_DIM).scatter_add_(1, index, content)
        counts = torch.zeros(len(content), self.groups).scatter_add_(1, tags, torch.ones(tags.shape))
        means = sums / counts[..., None]
        return means.gather(1, index) @ self.teacher["v"]

    def teacher_matrix(self, tags: torch.Tensor) -> torch.Tensor:
        """The groups teacher's ``(N, N)`` attention matrix for one input's tags ``(N,)``:
        ``A[i, j] = 1[tag_i = tag_j] / |{k: tag_k = tag_i}|``; its rank is the number of tags (all present)."""
        same = (tags[:, None] == tags[None, :]).double()
        return same / same.sum(dim=1, keepdim=True)

    def _groups(self, size: int, generator: torch.Generator) -> Batch:
        content = torch.randn(size, self.tokens, CONTENT_DIM, generator=generator)
        tags = self.group_tags(size, generator)
        x = torch.cat([content, F.one_hot(tags, self.groups).float()], dim=-1)
        return Batch(self._with_positions(x), self.groups_teacher(content, tags))

    def _recall(self, size: int, generator: torch.Generator) -> Batch:
        """Token types: 0 filler, 1 a (key, value) pair, 2 a query holding one of the pairs' keys."""
        n, pairs = self.tokens, self.pairs
        kinds = torch.zeros(size, n, dtype=torch.long)
        keys = torch.zeros(size, n, dtype=torch.long)
        values = torch.zeros(size, n, dtype=torch.long)
        for b in range(size):
            where = torch.randperm(n, generator=generator)[: 2 * pairs]
            chosen = torch.randperm(self.keys, generator=generator)[:pairs]
            answer = torch.randint(RECALL_VALUES, (pairs,), generator=generator)
            asked = torch.randperm(pairs, generator=generator)
            kinds[b, where[:pairs]], keys[b, where[:pairs]], values[b, where[:pairs]] = 1, chosen, answer
            kinds[b, where[pairs:]], keys[b, where[pairs:]], values[b, where[pairs:]] = 2, chosen[asked], answer[asked]
        pair = (kinds == 1).float()[..., None]
        content = torch.cat(
            [
                F.one_hot(kinds, 3).float(),
                F.one_hot(keys, self.keys).float() * (kinds > 0)[..., None],
                F.one_hot(values, RECALL_VALUES).float() * pair,
            ],
            dim=-1,
        )
        return Batch(self._with_positions(content), values, kinds == 2)

    def loss(self, prediction: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean squared error (local, groups) or cross-entropy over the query tokens (recall)."""
        if self.name != "recall":
            return F.mse_loss(prediction, batch.target)
        return F.cross_entropy(prediction[batch.mask], batch.target[batch.mask])

    def score(self, prediction: torch.Tensor, batch: Batch) -> float:
        """Relative error ``|y_hat - y| / |y|`` (local, groups) or recall accuracy over the query tokens."""
        if self.name != "recall":
            return float((prediction - batch.target).norm() / batch.target.norm())
        return float((prediction[batch.mask].argmax(-1) == batch.target[batch.mask]).float().mean())

    def held_out(self, size: int) -> Batch:
        """The held-out inputs every student of this task and grid size is scored (and its rank measured) on."""
        return self.batch(size, torch.Generator().manual_seed(EVAL_SEED))


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, N, H * D)`` -> ``(B, H, N, D)``."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, N, H * D)``."""
    return x.transpose(1, 2).flatten(2)


def shuffled_mixing(layout: tuple[int, int]) -> torch.Tensor:
    """The locality-initialised mixing of ``layout`` (:func:`~mhla_diffusion.ops.mixing.mixing_init`) with its
    key blocks (columns) permuted by a fixed derangement drawn from :data:`SHUFFLE_SEED`: every query block
    keeps the same weights (and the matrix its rank and column sums) but gives its largest to another block,
    with no relation to distance. One block: ``[[1]]``."""
    mixing = mixing_init(layout)
    m = mixing.shape[0]
    if m == 1:
        return mixing
    g = torch.Generator().manual_seed(SHUFFLE_SEED)
    while True:
        perm = torch.randperm(m, generator=g)
        if not bool((perm == torch.arange(m)).any()):
            return mixing[:, perm]


def mhla_rank_bound(tokens: int, layout: tuple[int, int], head_dim: int) -> int:
    """``sum_b min(n_b, d)`` over the equal blocks of ``layout`` on ``tokens`` tokens: the most the rank of an MHLA
    attention matrix can be (each query block's rows are ``phi(Q_b)`` times one ``d`` x ``N`` matrix)."""
    blocks = num_blocks(layout)
    return blocks * min(tokens // blocks, head_dim)


def token_permutation(tokens: int) -> torch.Tensor:
    """The fixed random order (from :data:`PERMUTE_SEED`) in which ``mhla-permuted`` lays ``tokens`` tokens on
    its grid."""
    return torch.randperm(tokens, generator=torch.Generator().manual_seed(PERMUTE_SEED))


class AttentionStudent(nn.Module):
    """One attention layer of ``kind`` (:data:`STUDENTS`) between linear maps, on a ``side`` x ``side`` grid;
    the MHLA kinds cut it into ``layout`` blocks (default :func:`mhla_layout`)."""

    def __init__(
        self,
        kind: str,
        in_dim: int,
        out_dim: int,
        side: int,
        heads: int,
        head_dim: int,
        layout: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if kind not in STUDENTS:
            raise ValueError(f"unknown student {kind!r}: choose from {', '.join(STUDENTS)}")
        self.kind, self.grid, self.heads = kind, (side, side), heads
        blocks = layout or mhla_layout(side)
        # linear-wide: queries and keys as wide as MHLA's rank bound at these blocks, values d wide
        self.key_dim = mhla_rank_bound(side * side, blocks, head_dim) if kind == "linear-wide" else head_dim
        self.qk = nn.Linear(in_dim, 2 * heads * self.key_dim)
        self.v = nn.Linear(in_dim, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, out_dim)
        self.layout = blocks if kind.startswith("mhla") else (1, 1)
        m = num_blocks(self.layout)
        if kind == "mhla-uniform":
            mixing = torch.full((m, m), 1.0 / m)
        elif kind == "mhla-shuffled":
            mixing = shuffled_mixing(self.layout)
        else:
            mixing = mixing_init(self.layout)  # locality-initialised; [[1]] for one block
        if kind == "mhla-per-head":
            mixing = mixing.expand(heads, -1, -1).clone()
        if kind in ("mhla", "mhla-per-head", "mhla-permuted", "mhla-lepe"):
            self.mixing = nn.Parameter(mixing)
        else:
            self.register_buffer("mixing", mixing, persistent=False)
        self.lepe = None
        if kind in ("linear-lepe", "mhla-lepe"):
            inner = heads * head_dim
            self.lepe = nn.Conv2d(inner, inner, kernel_size=3, padding=1, groups=inner)
        self.order = token_permutation(side * side) if kind == "mhla-permuted" else None
        self.plan = block_plan(self.grid, self.layout)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys ``(B, N, H, key_dim)``, values ``(B, N, H, D)`` (raw projections: the operator applies
        the feature map)."""
        q, k = (t.unflatten(-1, (self.heads, -1)) for t in self.qk(x).chunk(2, dim=-1))
        return q, k, self.v(x).unflatten(-1, (self.heads, -1))

    def lepe_term(self, v: torch.Tensor) -> torch.Tensor:
        """LePE's ``(B, N, H * D)`` term for values ``(B, N, H, D)``: a depthwise 3x3 convolution over the grid
        (zero for kinds without LePE)."""
        flat = v.flatten(2)
        if self.lepe is None:
            return torch.zeros_like(flat)
        batch, n, channels = flat.shape
        image = flat.transpose(1, 2).reshape(batch, channels, *self.grid)
        return self.lepe(image).reshape(batch, channels, n).transpose(1, 2)

    def _linear(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The operator on ``(B, N, H, .)`` inputs, with ``mhla-permuted``'s tokens laid on the grid in its order."""
        if self.order is None:
            return mhla_attention(q, k, v, self.grid, self.layout, self.mixing, feature_eps=FEATURE_EPS, plan=self.plan)
        order = self.order
        out = mhla_attention(
            q[:, order],
            k[:, order],
            v[:, order],
            self.grid,
            self.layout,
            self.mixing,
            feature_eps=FEATURE_EPS,
            plan=self.plan,
        )
        return torch.empty_like(out).index_copy_(1, order, out)  # back to grid order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        if self.kind == "softmax":
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
                1, 2
            )
        else:
            out = self._linear(q, k, v)
        out = out.flatten(2)
        if self.lepe is not None:
            out = out + self.lepe_term(v)
        return self.out(out)

    @torch.no_grad()
    def attention_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """The ``(H, N, N)`` attention matrix of one input ``x`` ``(N, C)``: row ``i`` weighs the values of
        every token for query ``i``. For the linear kinds it is the operator applied to the identity as values
        (``phi(q_i).phi(k_j) W[b(i), b(j)]`` over its normaliser), so it is exactly what the layer's attention
        computes; LePE's convolution (:meth:`lepe_term`) is added after it and is not part of the matrix."""
        q, k, _ = self._qkv(x[None].float())
        if self.kind == "softmax":
            scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * q.shape[-1] ** -0.5
            return scores.softmax(dim=-1)[0]
        n = x.shape[0]
        identity = torch.eye(n).expand(1, self.heads, n, n).transpose(1, 2)  # values (1, N, H, N)
        return self._linear(q, k, identity)[0].transpose(0, 1)


def rank_bound(kind: str, tokens: int, head_dim: int, layout: tuple[int, int] | None = None) -> int:
    """The most the rank of a student's N x N attention matrix can be: ``d`` for global linear attention
    (with or without LePE, whose convolution is outside the matrix) and for uniform mixing (every query block
    reads the same mixed summary); :func:`mhla_rank_bound` at ``layout`` (default :func:`mhla_layout`) for the
    other MHLA kinds and, through its wide heads, for ``linear-wide``; ``N`` for softmax."""
    side = grid_side(tokens)
    if kind not in STUDENTS:
        raise ValueError(f"unknown student {kind!r}: choose from {', '.join(STUDENTS)}")
    if kind == "softmax":
        return tokens
    if kind in ("linear", "linear-lepe", "mhla-uniform"):
        return min(tokens, head_dim)
    return min(tokens, mhla_rank_bound(tokens, layout or mhla_layout(side), head_dim))


def _rank_key(tolerance: float) -> str:
    return f"rank_{tolerance:.0e}".replace("e-0", "e-")


#: The measures of :func:`attention_measures`, in order: ``rank_1e-3``, ``rank_1e-2``, effective rank, entropy.
RANK_MEASURES = (*(_rank_key(t) for t in RANK_TOLERANCES), "effective_rank", "row_entropy")


def attention_measures(matrix: torch.Tensor) -> dict[str, float]:
    """Numerical ranks (singular values above each of :data:`RANK_TOLERANCES` x the largest: ``rank_1e-3``,
    ``rank_1e-2``), effective rank (``exp`` of the entropy of the normalised singular values) and mean row
    entropy (nats) of an ``(N, N)`` matrix whose rows are non-negative weights summing to 1."""
    values = torch.linalg.svdvals(matrix.double())
    p = values / values.sum()
    p = p[p > 0]
    rows = matrix.double().clamp_min(0)
    rows = rows / rows.sum(dim=-1, keepdim=True)
    entropy = -(rows * rows.clamp_min(1e-300).log()).sum(dim=-1)
    ranks = {_rank_key(t): int((values > t * values[0]).sum()) for t in RANK_TOLERANCES}
    return {
        **ranks,
        "effective_rank": float(torch.exp(-(p * p.log()).sum())),
        "row_entropy": float(entropy.mean()),
    }


CURVE_POINTS = 10  # the training loss is kept as the mean of each tenth of the steps


def train_students(
    task: Task,
    kinds: list[str],
    seed: int,
    steps: int,
    batch_size: int,
    lr: float | Mapping[str, float],
    eval_size: int,
    rank_max_tokens: int,
) -> list[dict[str, Any]]:
    """Fit one student of each of ``kinds`` to ``task`` from ``seed``, in lockstep on the same batches (one
    teacher call per step serves them all), with learning rate ``lr`` (or ``lr[kind]``). Per student: its
    held-out score, its training-loss curve (the mean of each tenth of the steps), its CPU seconds per training
    step, and for ``N <= rank_max_tokens`` the measures of each head's attention matrix on the first held-out
    input, averaged over heads, after training (``rank``) and before (``rank_untrained``)."""
    rates = {kind: float(lr[kind] if isinstance(lr, Mapping) else lr) for kind in kinds}
    students = {}
    for kind in kinds:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            students[kind] = AttentionStudent(
                kind, task.in_dim, task.out_dim, task.side, task.heads, task.head_dim, task.layout
            )
    held_out = task.held_out(eval_size)
    untrained = {
        kind: _rank_measures(student, held_out) if task.tokens <= rank_max_tokens else None
        for kind, student in students.items()
    }
    optimizers = {kind: torch.optim.Adam(student.parameters(), lr=rates[kind]) for kind, student in students.items()}
    losses: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu = dict.fromkeys(kinds, 0.0) | {"teacher": 0.0}
    for step in range(steps):
        began = time.process_time()
        batch = task.batch(batch_size, step_generator(seed, step))
        cpu["teacher"] += time.process_time() - began
        for kind, student in students.items():
            began = time.process_time()
            loss = task.loss(student(batch.x), batch)
            optimizers[kind].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[kind].step()
            losses[kind].append(float(loss.detach()))
            cpu[kind] += time.process_time() - began
    return [
        _measure(task, kind, student, held_out, seed, steps, losses[kind], cpu, rank_max_tokens)
        | {"lr": rates[kind], "rank_untrained": untrained[kind]}
        for kind, student in students.items()
    ]


def _rank_measures(student: AttentionStudent, held_out: Batch) -> dict[str, float]:
    """:func:`attention_measures` of each head's matrix on the first held-out input, averaged over heads."""
    heads = [attention_measures(m) for m in student.attention_matrix(held_out.x[0])]
    return {name: float(np.mean([h[name] for h in heads])) for name in heads[0]}


def loss_curve(losses: list[float], points: int = CURVE_POINTS) -> list[float]:
    """The mean of ``losses`` over each of ``points`` equal (to one step) consecutive stretches."""
    if not losses:
        return []
    chunks = np.array_split(np.asarray(losses, dtype=float), min(points, len(losses)))
    return [float(c.mean()) for c in chunks]


@torch.no_grad()
def _measure(
    task: Task,
    kind: str,
    student: AttentionStudent,
    held_out: Batch,
    seed: int,
    steps: int,
    losses: list[float],
    cpu: dict[str, float],
    rank_max_tokens: int,
) -> dict[str, Any]:
    return {
        "task": task.name,
        "student": kind,
        "tokens": task.tokens,
        "seed": seed,
        "steps": steps,
        "score": task.score(student(held_out.x), held_out),
        "final_loss": float(np.mean(losses[-20:])) if losses else None,
        "loss_curve": loss_curve(losses),
        "cpu_seconds_per_step": round(cpu[kind] / max(steps, 1), 4),
        "teacher_cpu_seconds_per_step": round(cpu["teacher"] / max(steps, 1), 4),
        "layout": list(student.layout),
        "rank_bound": rank_bound(kind, task.tokens, task.head_dim, task.layout),
        "teacher_rank": task.teacher_rank,
        "chance_loss": task.chance_loss,
        "rank": _rank_measures(student, held_out) if task.tokens <= rank_max_tokens else None,
    }


def choose_rates(sweep: list[dict[str, Any]]) -> dict[str, float]:
    """Student -> the learning rate of its sweep run (one per rate, one cell) whose training loss over the last
    tenth of the steps was lowest; ties go to the smaller rate."""
    best: dict[str, tuple[float, float]] = {}
    for run in sweep:
        key = (run["loss_curve"][-1], run["lr"])
        if run["student"] not in best or key < best[run["student"]]:
            best[run["student"]] = key
    return {student: lr for student, (_, lr) in best.items()}
