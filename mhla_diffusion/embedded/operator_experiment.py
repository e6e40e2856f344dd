"""Part A of ``mhla reproduce``: one attention layer fitted to a fixed teacher on a 2-D token grid, and
the rank of the N x N attention matrix it learned.

Tasks (:data:`TASKS`), each on a ``side`` x ``side`` grid of ``N = side**2`` tokens:

* ``local``: a fixed softmax attention whose logits add a sharp positional bias
  ``-|p_i - p_j|**2 / (2 LOCAL_WIDTH**2)`` (grid units) to its content term; the teacher's output on
  Gaussian token contents is the target, scored by the relative error ``|y_hat - y| / |y|`` on held-out
  inputs. The width is fixed in tokens, so the teacher grows more local relative to the grid as N grows.
* ``recall``: associative recall. ``RECALL_PAIRS`` tokens anywhere in the grid each hold a (key, value)
  pair, ``RECALL_PAIRS`` other tokens each hold one of those keys as a query, the rest are filler; every
  query token must output its key's value. Scored by the recall accuracy on held-out grids.

Every student sees the token contents concatenated with fixed 2-D sinusoidal position features
(:func:`position_features`), and is one attention layer (``heads`` x ``head_dim``) between linear maps
(:class:`AttentionStudent`, kinds in :data:`STUDENTS`): global linear attention (the MHLA operator with
one block: the same feature map ``ReLU(x) + eps``), MHLA (``M <= sqrt(N)`` blocks, learnable mixing
initialised from block distances), MHLA with one mixing matrix per head, and softmax. Every draw depends
on ``(seed, step)`` only, so the students of one seed see the same batches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention import mhla_attention
from ..ops.block_layout import block_plan, num_blocks
from ..ops.mixing import mixing_init
from .training_loop import step_generator

__all__ = [
    "STUDENTS",
    "TASKS",
    "AttentionStudent",
    "Task",
    "attention_measures",
    "mhla_layout",
    "rank_bound",
    "train_students",
]

STUDENTS = ("linear", "mhla", "mhla-per-head", "softmax")
TASKS = ("local", "recall")
CONTENT_DIM = 32  # the local task's token contents and output
POSITION_FREQUENCIES = 8  # per axis and per sin / cos: 32 position features
LOCAL_WIDTH = 1.5  # the local teacher's positional bias width, in tokens
RECALL_KEYS, RECALL_VALUES, RECALL_PAIRS = 32, 16, 8
TEACHER_SEED, EVAL_SEED = 1234, 5678
FEATURE_EPS = 1e-6
RANK_TOLERANCE = 1e-3  # numerical rank: singular values above this fraction of the largest


def mhla_layout(side: int) -> tuple[int, int]:
    """``k`` x ``k`` blocks on a ``side`` x ``side`` grid: the largest power of two ``k`` dividing ``side``
    with ``M = k * k <= sqrt(N)`` (the paper's rule): 2x2 at 64 tokens, 4x4 at 256 and 1,024, 8x8 at 4,096."""
    k = 1
    while side % (2 * k) == 0 and (2 * k) ** 2 <= side:
        k *= 2
    return (k, k)


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


class Task:
    """One teacher at one grid size: draws batches (a pure function of the generator) and scores students."""

    def __init__(self, name: str, tokens: int, heads: int, head_dim: int) -> None:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}: choose from {', '.join(TASKS)}")
        self.name, self.tokens, self.side = name, tokens, grid_side(tokens)
        self.positions = position_features(self.side)
        self.heads, self.head_dim = heads, head_dim
        if name == "local":
            g = torch.Generator().manual_seed(TEACHER_SEED)  # one teacher for every grid size and seed
            scale = CONTENT_DIM**-0.5
            self.teacher = {w: torch.randn(CONTENT_DIM, heads * head_dim, generator=g) * scale for w in "qkv"}
            self.teacher["o"] = torch.randn(heads * head_dim, CONTENT_DIM, generator=g) * (heads * head_dim) ** -0.5
            coords = torch.cartesian_prod(torch.arange(self.side), torch.arange(self.side)).float()
            self.bias = -(torch.cdist(coords, coords) ** 2) / (2 * LOCAL_WIDTH**2)

    @property
    def in_dim(self) -> int:
        extra = CONTENT_DIM if self.name == "local" else 3 + RECALL_KEYS + RECALL_VALUES
        return extra + self.positions.shape[1]

    @property
    def out_dim(self) -> int:
        return CONTENT_DIM if self.name == "local" else RECALL_VALUES

    def batch(self, size: int, generator: torch.Generator) -> Batch:
        """``size`` fresh inputs and their targets."""
        return self._local(size, generator) if self.name == "local" else self._recall(size, generator)

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

    def _recall(self, size: int, generator: torch.Generator) -> Batch:
        """Token types: 0 filler, 1 a (key, value) pair, 2 a query holding one of the pairs' keys."""
        n, pairs = self.tokens, RECALL_PAIRS
        kinds = torch.zeros(size, n, dtype=torch.long)
        keys = torch.zeros(size, n, dtype=torch.long)
        values = torch.zeros(size, n, dtype=torch.long)
        for b in range(size):
            where = torch.randperm(n, generator=generator)[: 2 * pairs]
            chosen = torch.randperm(RECALL_KEYS, generator=generator)[:pairs]
            answer = torch.randint(RECALL_VALUES, (pairs,), generator=generator)
            asked = torch.randperm(pairs, generator=generator)
            kinds[b, where[:pairs]], keys[b, where[:pairs]], values[b, where[:pairs]] = 1, chosen, answer
            kinds[b, where[pairs:]], keys[b, where[pairs:]], values[b, where[pairs:]] = 2, chosen[asked], answer[asked]
        pair = (kinds == 1).float()[..., None]
        content = torch.cat(
            [
                F.one_hot(kinds, 3).float(),
                F.one_hot(keys, RECALL_KEYS).float() * (kinds > 0)[..., None],
                F.one_hot(values, RECALL_VALUES).float() * pair,
            ],
            dim=-1,
        )
        return Batch(self._with_positions(content), values, kinds == 2)

    def loss(self, prediction: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean squared error (local) or cross-entropy over the query tokens (recall)."""
        if self.name == "local":
            return F.mse_loss(prediction, batch.target)
        return F.cross_entropy(prediction[batch.mask], batch.target[batch.mask])

    def score(self, prediction: torch.Tensor, batch: Batch) -> float:
        """Relative error ``|y_hat - y| / |y|`` (local) or recall accuracy over the query tokens (recall)."""
        if self.name == "local":
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


class AttentionStudent(nn.Module):
    """One attention layer of ``kind`` (:data:`STUDENTS`) between linear maps, on a ``side`` x ``side`` grid."""

    def __init__(self, kind: str, in_dim: int, out_dim: int, side: int, heads: int, head_dim: int) -> None:
        super().__init__()
        if kind not in STUDENTS:
            raise ValueError(f"unknown student {kind!r}: choose from {', '.join(STUDENTS)}")
        self.kind, self.grid, self.heads = kind, (side, side), heads
        self.qkv = nn.Linear(in_dim, 3 * heads * head_dim)
        self.out = nn.Linear(heads * head_dim, out_dim)
        self.layout = (1, 1) if kind in ("linear", "softmax") else mhla_layout(side)
        mixing = mixing_init(self.layout)  # locality-initialised; [[1]] for one block
        if kind == "mhla-per-head":
            mixing = mixing.expand(heads, -1, -1).clone()
        if kind.startswith("mhla"):
            self.mixing = nn.Parameter(mixing)
        else:
            self.register_buffer("mixing", mixing, persistent=False)
        self.plan = block_plan(self.grid, self.layout)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``(B, N, H, D)`` (raw projections: the operator applies the feature map)."""
        return tuple(t.unflatten(-1, (self.heads, -1)) for t in self.qkv(x).chunk(3, dim=-1))  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        if self.kind == "softmax":
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
                1, 2
            )
        else:
            out = mhla_attention(q, k, v, self.grid, self.layout, self.mixing, feature_eps=FEATURE_EPS, plan=self.plan)
        return self.out(out.flatten(2))

    @torch.no_grad()
    def attention_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """The ``(H, N, N)`` attention matrix of one input ``x`` ``(N, C)``: row ``i`` weighs the values of
        every token for query ``i``. For the linear kinds it is the operator applied to the identity as values
        (``phi(q_i).phi(k_j) W[b(i), b(j)]`` over its normaliser), so it is exactly what the layer computes."""
        q, k, _ = self._qkv(x[None].float())
        if self.kind == "softmax":
            scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * q.shape[-1] ** -0.5
            return scores.softmax(dim=-1)[0]
        n = x.shape[0]
        identity = torch.eye(n).expand(1, self.heads, n, n).transpose(1, 2)  # values (1, N, H, N)
        return mhla_attention(
            q, k, identity, self.grid, self.layout, self.mixing, feature_eps=FEATURE_EPS, plan=self.plan
        )[0].transpose(0, 1)


def rank_bound(kind: str, tokens: int, head_dim: int) -> int:
    """The most the rank of a student's N x N attention matrix can be: ``d`` for global linear attention,
    ``sum_b min(n_b, d)`` over the blocks for MHLA (each query block's rows are ``phi(Q_b)`` times one
    ``d`` x ``N`` matrix), ``N`` for softmax."""
    side = grid_side(tokens)
    if kind == "softmax":
        return tokens
    layout = (1, 1) if kind == "linear" else mhla_layout(side)
    block_tokens = tokens // num_blocks(layout)  # mhla_layout divides the grid: equal blocks
    return num_blocks(layout) * min(block_tokens, head_dim)


def attention_measures(matrix: torch.Tensor) -> dict[str, float]:
    """Numerical rank (singular values above :data:`RANK_TOLERANCE` x the largest), effective rank (``exp``
    of the entropy of the normalised singular values) and mean row entropy (nats) of an ``(N, N)`` matrix
    whose rows are non-negative weights summing to 1."""
    values = torch.linalg.svdvals(matrix.double())
    p = values / values.sum()
    p = p[p > 0]
    rows = matrix.double().clamp_min(0)
    rows = rows / rows.sum(dim=-1, keepdim=True)
    entropy = -(rows * rows.clamp_min(1e-300).log()).sum(dim=-1)
    return {
        "numerical_rank": int((values > RANK_TOLERANCE * values[0]).sum()),
        "effective_rank": float(torch.exp(-(p * p.log()).sum())),
        "row_entropy": float(entropy.mean()),
    }


def train_students(
    task: Task,
    kinds: list[str],
    seed: int,
    steps: int,
    batch_size: int,
    lr: float,
    eval_size: int,
    rank_max_tokens: int,
) -> list[dict[str, Any]]:
    """Fit one student of each of ``kinds`` to ``task`` from ``seed``, in lockstep on the same batches (one
    teacher call per step serves them all). Per student: its held-out score, its CPU seconds per training
    step, and for ``N <= rank_max_tokens`` the measures of each head's attention matrix on the first
    held-out input, averaged over heads."""
    students = {}
    for kind in kinds:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            students[kind] = AttentionStudent(kind, task.in_dim, task.out_dim, task.side, task.heads, task.head_dim)
    optimizers = {kind: torch.optim.Adam(student.parameters(), lr=lr) for kind, student in students.items()}
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
    held_out = task.held_out(eval_size)
    return [
        _measure(task, kind, student, held_out, seed, steps, losses[kind], cpu, rank_max_tokens)
        for kind, student in students.items()
    ]


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
    result: dict[str, Any] = {
        "task": task.name,
        "student": kind,
        "tokens": task.tokens,
        "seed": seed,
        "steps": steps,
        "score": task.score(student(held_out.x), held_out),
        "final_loss": float(np.mean(losses[-20:])),
        "cpu_seconds_per_step": round(cpu[kind] / max(steps, 1), 4),
        "teacher_cpu_seconds_per_step": round(cpu["teacher"] / max(steps, 1), 4),
        "layout": list(student.layout),
        "rank_bound": rank_bound(kind, task.tokens, task.head_dim),
        "rank": None,
    }
    if task.tokens <= rank_max_tokens:
        heads = [attention_measures(m) for m in student.attention_matrix(held_out.x[0])]
        result["rank"] = {name: float(np.mean([h[name] for h in heads])) for name in heads[0]}
    return result
