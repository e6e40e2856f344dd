"""Aspect-ratio / frame-count buckets and a deterministic, sharded, resumable batch sampler.

Every batch holds samples of one bucket, so mixed sizes train together without padding (MHLA works
on any token grid). The order of an epoch depends only on ``(seed, epoch)``; process ``rank`` of
``world`` takes every ``world``-th batch, and iteration can start at any batch of the epoch, which
is what makes ``--resume`` continue exactly where a run stopped.
"""

from __future__ import annotations

import math
import random
from typing import Hashable, Iterator, Sequence

from torch.utils.data import Sampler

__all__ = ["BucketBatchSampler", "frame_bucket", "frames_available", "nearest_resolution"]


def nearest_resolution(height: int, width: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket ``(h, w)`` whose aspect ratio is closest to ``height / width``.

    Distance is ``|log(h/w) - log(height/width)|`` (scale-free, so 4:3 is as far from 1:1 as 3:4);
    ties go to the earlier bucket.
    """
    ratio = math.log(height / width)
    return min(buckets, key=lambda hw: abs(math.log(hw[0] / hw[1]) - ratio))


def frames_available(num_frames: int, stride: int) -> int:
    """Frames a clip of ``num_frames`` yields when every ``stride``-th frame is taken."""
    return (num_frames - 1) // stride + 1 if num_frames > 0 else 0


def frame_bucket(num_frames: int, stride: int, buckets: Sequence[int]) -> int | None:
    """The largest frame bucket a video of ``num_frames`` frames can fill (``None``: too short)."""
    available = frames_available(num_frames, stride)
    fitting = [b for b in buckets if b <= available]
    return max(fitting) if fitting else None


class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields this process's batches of ``(sample index, epoch)`` pairs, one bucket per batch.

    Args:
        buckets: bucket key of every sample (any hashable, e.g. ``(frames, height, width)``).
        batch_size: samples per batch (per process). A bucket's last batch may be smaller unless ``drop_last``.
        num_replicas, rank: processes and this process's index.
        seed: with the epoch, fixes the order.
    """

    def __init__(
        self,
        buckets: Sequence[Hashable],
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} processes")
        self.buckets = list(buckets)
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.seed, self.drop_last = seed, drop_last
        self.epoch, self.start = 0, 0
        counts: dict[Hashable, int] = {}
        for key in self.buckets:
            counts[key] = counts.get(key, 0) + 1
        per_bucket = (n // batch_size if drop_last else -(-n // batch_size) for n in counts.values())
        self._length = sum(per_bucket) // num_replicas
        if self._length == 0:
            raise ValueError(
                f"{len(self.buckets)} samples make fewer batches of {batch_size} than there are processes "
                f"({num_replicas}) in some epoch: add data, lower train_batch_size or use fewer processes"
            )

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` in order, before sharding (a multiple of ``num_replicas``)."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        by_bucket: dict[Hashable, list[int]] = {}
        for index, key in enumerate(self.buckets):
            by_bucket.setdefault(key, []).append(index)
        batches: list[list[int]] = []
        for key in sorted(by_bucket, key=repr):
            indices = by_bucket[key]
            rng.shuffle(indices)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    batches.append(chunk)
        rng.shuffle(batches)
        return batches[: len(batches) // self.num_replicas * self.num_replicas]

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate ``epoch`` from this process's batch number ``start``."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        """Batches per epoch for this process (the same in every epoch)."""
        return self._length

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        mine = self.global_batches(self.epoch)[self.rank :: self.num_replicas]
        for batch in mine[self.start :]:
            yield [(index, self.epoch) for index in batch]
