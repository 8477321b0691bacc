"""Which samples each rank processes, and when.

Training: `DistributedSampler` (shuffled by seed + epoch) deals position j of the epoch's permutation
to rank j % world. Step t takes positions [t*B, (t+1)*B) of the permutation, B = global batch, so the
union over ranks of a step's micro batches is exactly the batch one process would take at the same
global batch: this is what makes losses comparable across strategies and world sizes. Each epoch has
floor(N / B) steps; the N mod B samples left over (different ones each epoch) are not used, so every
step has the same size and no sample is padded or repeated.

Evaluation: rank r takes samples r, r + world, ...; ranks with one sample fewer get a padding sample
whose mask is 0. Every rank runs the same number of forward passes (FSDP needs that) and every
sample is counted exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DistributedSampler

from dtlab.errors import DataError


class Dataset(Protocol):
    def __len__(self) -> int: ...
    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TrainLoader:
    def __init__(
        self,
        dataset: Dataset,
        rank: int,
        world_size: int,
        micro_batch: int,
        grad_accum_steps: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.dataset, self.micro, self.accum = dataset, micro_batch, grad_accum_steps
        self.global_batch = micro_batch * grad_accum_steps * world_size
        self.steps_per_epoch = len(dataset) // self.global_batch
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training set has {len(dataset)} samples, fewer than one global batch of "
                f"{self.global_batch}; fix: lower train.global_batch_size or use more data"
            )
        self.sampler = DistributedSampler(
            range(len(dataset)), world_size, rank, shuffle=shuffle, seed=seed, drop_last=True
        )

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for an epoch, shaped (steps, grad_accum_steps, micro_batch)."""
        self.sampler.set_epoch(epoch)
        used = self.steps_per_epoch * self.accum * self.micro
        idx = torch.tensor(list(self.sampler)[:used], dtype=torch.long)
        return idx.view(self.steps_per_epoch, self.accum, self.micro)

    def steps(self, start_step: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        """Endless (epoch, indices of one step) pairs, from global step `start_step` on."""
        epoch, offset = divmod(start_step, self.steps_per_epoch)
        while True:
            for step_idx in self.epoch_indices(epoch)[offset:]:
                yield epoch, step_idx
            epoch, offset = epoch + 1, 0


class EvalLoader:
    def __init__(self, dataset: Dataset, rank: int, world_size: int, batch_size: int,
                 pad: bool = True) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        n = len(dataset)
        per_rank = math.ceil(n / world_size)
        mine = torch.arange(rank, n, world_size)
        pad = per_rank - len(mine) if pad else 0
        self.indices = torch.cat([mine, torch.zeros(pad, dtype=torch.long)])
        self.mask = torch.cat([torch.ones(len(mine)), torch.zeros(pad)])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.indices), self.batch_size):
            idx = self.indices[start : start + self.batch_size]
            x, y = self.dataset.batch(idx)
            yield x, y, self.mask[start : start + self.batch_size].to(y.device)


class SampleUsage:
    """How often each training sample was used (run.track_samples): the evidence that every rank
    trained on different samples, and that an epoch covered each sample once."""

    def __init__(self, n_samples: int) -> None:
        self.counts = torch.zeros(n_samples, dtype=torch.float64)

    def add(self, step_idx: torch.Tensor) -> None:
        self.counts.index_add_(0, step_idx.flatten().cpu(), torch.ones(step_idx.numel(), dtype=torch.float64))

    def summary(self, strategy: Any) -> dict[str, int]:
        """Counts summed over the data-parallel replicas (each replica's samples once)."""
        counts = strategy.reduce_sum(self.counts.to(strategy.ctx.device)).cpu()
        used = counts[counts > 0]
        return {"dataset_samples": len(counts), "samples_processed": int(counts.sum()),
                "unique_samples": len(used), "min_uses_of_one_sample": int(counts.min()),
                "max_uses_of_one_sample": int(counts.max())}
