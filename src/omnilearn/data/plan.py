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
a restart. What the place means (seed, dataset length, batch, steps per
epoch: :func:`omnilearn.data.position.basis`) is saved by the session beside
it; :meth:`VariableBatchSampler.expect` refuses a plan that reads it
differently, now or, when the dataset comes later, in :meth:`use_plan`.

Run: ``python -m pytest -q tests/unit/test_sampler.py``
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from torch.utils.data import Sampler

from omnilearn.config import ConfigError
from omnilearn.data.position import basis, mismatch
from omnilearn.data.schedule import BatchSchedule, GlobalPlan, micro_sizes  # noqa: F401  (re-exported)


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
        self.expected: dict | None = None  # a loaded checkpoint's data basis, until the plan is known
        self.spe: int | None = None  # the plan's steps per epoch, once read

    def use_plan(self, plan: GlobalPlan) -> None:
        """Read the data by ``plan`` (:class:`ConfigError` if a loaded place means other samples under it)."""
        problem = mismatch(self.expected, basis(plan))
        if problem is not None:
            raise ConfigError(problem)
        self.plan, self.expected, self.spe = plan, None, None

    def basis(self) -> dict | None:
        """What the place means (:func:`omnilearn.data.position.basis`); None before the dataset is known."""
        return basis(self.plan) if self.plan is not None else self.expected

    def expect(self, saved: dict | None) -> None:
        """The place was loaded from a run whose data had ``saved`` basis: refuse another, now or in :meth:`use_plan`."""
        if self.plan is None:
            self.expected = saved
            return
        problem = mismatch(saved, basis(self.plan))
        if problem is not None:
            raise ConfigError(problem)

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
        """Step ``step`` was trained: the next iteration starts after it (never moves back). Every step: the
        steps per epoch are read once per plan (:meth:`use_plan`)."""
        if self.spe is None:
            self.spe = self._plan().steps_per_epoch
        epoch, offset = divmod(step + 1, self.spe)
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
        plain = type(plan).worker_indices is GlobalPlan.worker_indices and type(plan).step_indices is \
            GlobalPlan.step_indices and perm is not None
        at, rank, spe, batch = self.schedule.at, self.rank, plan.steps_per_epoch, plan.global_batch
        batches, mine = None, 0
        for step in steps:
            if plain:  # plan.worker_indices inline (every step): the slice's start is worked out once per plan
                plan_now = at(step)
                if plan_now is not batches:
                    plan.worker_indices(step, plan_now, rank, perm)  # checks the plan
                    batches, mine = plan_now, sum(plan_now[:rank])
                first = step % spe * batch + mine
                indices = perm[first : first + batches[rank]].tolist()
            else:
                indices = plan.worker_indices(step, at(step), rank, perm)
            if self.micro_steps == 1:  # the list itself: no copy per step
                yield indices
                continue
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
