"""Variable-batch data path: one global permutation per epoch, sliced by batch plan.

Epoch ``e`` shuffles all indices with a generator seeded by ``(seed, e)``;
step ``s`` of the epoch consumes the next ``B`` indices and worker ``i`` takes
the contiguous slice ``[sum(b[:i]), sum(b[:i+1]))`` of them. So every sample
is seen exactly once per epoch (the last ``N mod B`` are dropped), and the
samples of a step do not depend on the number of workers or on the split.

Batch sizes change at step boundaries through a :class:`BatchSchedule`; the
:class:`VariableBatchSampler` reads it lazily, so the ``DataLoader`` is never
rebuilt. A ``DataLoader`` with worker processes asks its (main-process) batch
sampler ``prefetch`` steps ahead, so a plan change must be registered at
least that many steps before it takes effect; the schedule refuses a change
for a step it has already handed out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler


@dataclass(frozen=True)
class GlobalPlan:
    """Which dataset indices each worker reads at each global step."""

    dataset_len: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.dataset_len < self.global_batch:
            raise ValueError(
                f"dataset of {self.dataset_len} samples cannot fill one global batch of {self.global_batch}; "
                "lower --global-batch"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch

    def permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.dataset_len)

    def step_indices(self, step: int, perm: np.ndarray | None = None) -> np.ndarray:
        """All ``B`` indices of global step ``step`` (in worker order)."""
        epoch, s = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch) if perm is None else perm
        return perm[s * self.global_batch : (s + 1) * self.global_batch]

    def worker_indices(self, step: int, batches: Sequence[int], rank: int, perm: np.ndarray | None = None) -> list[int]:
        """The contiguous slice of step ``step`` that worker ``rank`` trains on."""
        if sum(batches) != self.global_batch:
            raise ValueError(f"batches {list(batches)} do not sum to the global batch {self.global_batch}")
        start = sum(batches[:rank])
        return self.step_indices(step, perm)[start : start + batches[rank]].tolist()


@dataclass
class BatchSchedule:
    """Batch vector in force at each global step: a list of (first_step, batches)."""

    initial: tuple[int, ...]
    _starts: list[int] = field(default_factory=list)
    _plans: list[tuple[int, ...]] = field(default_factory=list)
    _max_read: int = -1

    def __post_init__(self) -> None:
        self._starts, self._plans = [0], [tuple(self.initial)]

    def at(self, step: int) -> tuple[int, ...]:
        """The plan for ``step``, which from now on may not change."""
        self._max_read = max(self._max_read, step)
        return self.peek(step)

    def peek(self, step: int) -> tuple[int, ...]:
        """The plan for ``step`` as registered so far (a later change may still replace it)."""
        return self._plans[bisect.bisect_right(self._starts, step) - 1]

    def change(self, from_step: int, batches: Sequence[int]) -> None:
        """Use ``batches`` from ``from_step`` on (must be a step not handed out yet)."""
        if from_step <= self._max_read:
            raise RuntimeError(
                f"batch change for step {from_step} arrives after step {self._max_read} was already sampled"
            )
        if from_step <= self._starts[-1]:
            raise RuntimeError(f"batch changes must move forward: {from_step} <= {self._starts[-1]}")
        self._starts.append(from_step)
        self._plans.append(tuple(batches))


class VariableBatchSampler(Sampler[list[int]]):
    """``batch_sampler`` for a ``DataLoader``: yields this rank's indices per step."""

    def __init__(self, plan: GlobalPlan, schedule: BatchSchedule, rank: int, steps: int | None = None) -> None:
        self.plan, self.schedule, self.rank = plan, schedule, rank
        self.epoch = 0
        self.total_steps = steps  # stop after this many global steps (None: whole epochs)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def steps(self) -> range:
        """The global steps of the current epoch."""
        spe = self.plan.steps_per_epoch
        first = self.epoch * spe
        last = first + spe if self.total_steps is None else min(first + spe, self.total_steps)
        return range(first, max(first, last))

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.plan.permutation(self.epoch)
        for step in self.steps():
            yield self.plan.worker_indices(step, self.schedule.at(step), self.rank, perm)

    def __len__(self) -> int:
        return len(self.steps())
