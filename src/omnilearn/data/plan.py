"""Variable-batch data path: one global permutation per epoch, sliced by batch plan.

Epoch ``e`` shuffles all indices with a generator seeded by ``(seed, e)``;
step ``s`` of the epoch consumes the next ``B`` indices and worker ``i`` takes
the contiguous slice ``[sum(b[:i]), sum(b[:i+1]))`` of them. So every sample
is seen exactly once per epoch (the last ``N mod B`` are dropped), and the
samples of a step do not depend on the number of workers or on the split.
With gradient accumulation a worker's slice is cut, in order, into
``accumulation_steps`` micro-batches as equal as possible (:func:`micro_sizes`).

Batch sizes change at step boundaries through a :class:`BatchSchedule`; the
:class:`VariableBatchSampler` reads it lazily, so the ``DataLoader`` is never
rebuilt. A ``DataLoader`` with worker processes asks its (main-process) batch
sampler ``prefetch`` index lists ahead, so a plan change must be registered
at least that many steps before it takes effect; the schedule refuses a
change for a step it has already handed out (:attr:`BatchSchedule.last_read`).

The sampler keeps its place as ``(epoch, offset)``: where its next
``__iter__`` starts. ``set_epoch`` moves it forward only; ``complete(step)``
(the session, when a step is reported) moves it past a finished step;
``state_dict()`` / ``load_state_dict()`` carry it (and the schedule) across
a restart.

Run: ``python -m pytest -q tests/unit/test_sampler.py``
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler


def micro_sizes(batch: int, parts: int) -> tuple[int, ...]:
    """``batch`` cut into ``parts`` sizes as equal as possible (the larger first); none may be empty."""
    if parts < 1 or batch < parts:
        raise ValueError(f"a batch of {batch} cannot be cut into {parts} non-empty micro-batches")
    q, r = divmod(batch, parts)
    return tuple(q + 1 if j < r else q for j in range(parts))


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


class BatchSchedule:
    """Batch vector in force at each global step: changes as (first_step, batches), in step order."""

    def __init__(self, initial: Sequence[int]) -> None:
        self.starts: list[int] = [0]
        self.plans: list[tuple[int, ...]] = [tuple(int(b) for b in initial)]
        self.last_read = -1  # the latest step whose plan was handed out (transient: not in the state)

    @property
    def initial(self) -> tuple[int, ...]:
        return self.plans[0]

    def at(self, step: int) -> tuple[int, ...]:
        """The plan for ``step``, which from now on may not change."""
        self.last_read = max(self.last_read, step)
        return self.peek(step)

    def peek(self, step: int) -> tuple[int, ...]:
        """The plan for ``step`` as registered so far (a later change may still replace it)."""
        return self.plans[bisect.bisect_right(self.starts, step) - 1]

    def change(self, from_step: int, batches: Sequence[int]) -> None:
        """Use ``batches`` from ``from_step`` on (must be a step not handed out yet)."""
        if from_step <= self.last_read:
            raise RuntimeError(
                f"batch change for step {from_step} arrives after step {self.last_read} was already sampled"
            )
        if from_step <= self.starts[-1]:
            raise RuntimeError(f"batch changes must move forward: {from_step} <= {self.starts[-1]}")
        self.starts.append(int(from_step))
        self.plans.append(tuple(int(b) for b in batches))

    def state_dict(self) -> dict:
        return {"starts": list(self.starts), "plans": [list(p) for p in self.plans]}

    def load_state_dict(self, state: dict) -> None:
        starts, plans = [int(s) for s in state["starts"]], [tuple(int(b) for b in p) for p in state["plans"]]
        if len(plans[0]) != len(self.plans[0]):
            raise ValueError(f"a schedule for {len(plans[0])} workers loaded into one for {len(self.plans[0])}")
        self.starts, self.plans = starts, plans


class VariableBatchSampler(Sampler[list[int]]):
    """``batch_sampler`` for a ``DataLoader``: this rank's indices per step (per micro-batch).

    ``plan`` may be given later (:meth:`use_plan`): the sampler's place and
    state exist before the dataset does.
    """

    def __init__(self, plan: GlobalPlan | None, schedule: BatchSchedule, rank: int, steps: int | None = None,
                 micro_steps: int = 1) -> None:
        self.plan, self.schedule, self.rank = plan, schedule, rank
        self.total_steps = steps  # stop before this global step (None: whole epochs)
        self.micro_steps = micro_steps
        self.epoch, self.offset = 0, 0  # where the next __iter__ starts

    def use_plan(self, plan: GlobalPlan) -> None:
        self.plan = plan

    def _plan(self) -> GlobalPlan:
        if self.plan is None:
            raise RuntimeError("the sampler has no dataset yet: call data_loader() first")
        return self.plan

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (the current one: no change). Epochs only move forward."""
        if epoch < self.epoch:
            raise RuntimeError(f"set_epoch({epoch}): the loader is already at epoch {self.epoch} (data order "
                               f"depends on epoch and step, so epochs only move forward); call set_epoch({self.epoch}) "
                               "or later")
        if epoch > self.epoch:
            self.epoch, self.offset = epoch, 0

    def complete(self, step: int) -> None:
        """Step ``step`` was trained: the next iteration starts after it (never moves back)."""
        spe = self._plan().steps_per_epoch
        epoch, offset = divmod(step + 1, spe)
        if (epoch, offset) > (self.epoch, self.offset):
            self.epoch, self.offset = epoch, offset

    def end_epoch(self, epoch: int) -> None:
        """An iteration ran through ``epoch``: the next one starts the epoch after (unless already further)."""
        if (epoch + 1, 0) > (self.epoch, self.offset):
            self.epoch, self.offset = epoch + 1, 0

    def steps(self) -> range:
        """The global steps the next iteration hands out (from the current place to the epoch's end)."""
        spe = self._plan().steps_per_epoch
        first, end = self.epoch * spe + self.offset, (self.epoch + 1) * spe
        last = end if self.total_steps is None else min(end, self.total_steps)
        return range(first, max(first, last))

    def __iter__(self) -> Iterator[list[int]]:
        """Reads the place now (not at the first ``next``), so a ``DataLoader`` iterator made now starts here."""
        return self._indices(self._plan(), self.steps(), self._plan().permutation(self.epoch))

    def _indices(self, plan: GlobalPlan, steps: range, perm: np.ndarray) -> Iterator[list[int]]:
        for step in steps:
            indices = plan.worker_indices(step, self.schedule.at(step), self.rank, perm)
            start = 0
            for size in micro_sizes(len(indices), self.micro_steps):
                yield indices[start : start + size]
                start += size

    def __len__(self) -> int:
        """Index lists the next iteration yields (steps x micro-batches)."""
        return len(self.steps()) * self.micro_steps

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
