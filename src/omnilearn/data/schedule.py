"""The data plan's pure half: which samples each worker reads at each step, and the batch plan in force.

:class:`GlobalPlan`: epoch ``e`` shuffles all indices with a generator seeded
by ``(seed, e)`` (numpy); step ``s`` of the epoch takes the next ``B`` of them
and worker ``i`` the contiguous slice ``[sum(b[:i]), sum(b[:i+1]))``, so the
samples of a step depend on neither the worker count nor the split.
:class:`BatchSchedule`: the batch vector in force at each step, changed at
step boundaries. :func:`micro_sizes`: a share cut into micro-batches.

No torch here: the PyTorch data path (:mod:`omnilearn.data.plan`'s sampler)
and the TensorFlow runtime (:mod:`omnilearn.tf`) both read it.

Run: ``python -m pytest -q tests/unit/test_sampler.py``
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import numpy as np


def micro_sizes(batch: int, parts: int) -> tuple[int, ...]:
    """``batch`` cut into ``parts`` sizes as equal as possible (the larger first); none may be empty."""
    if parts == 1 and batch >= 1:  # no accumulation: every step's case
        return (batch,)
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

    KIND: ClassVar[str] = "dataset"  # what :mod:`omnilearn.data.position` calls this kind of plan
    RESUME_FIELDS: ClassVar[tuple[str, ...]] = ("global_batch", "dataset_len", "seed", "steps_per_epoch",
                                                "partial_batch")  # what a saved data position depends on
    partial_batch: ClassVar[str] = "dropped"  # an epoch's last N mod B samples

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.dataset_len < self.global_batch:
            raise ValueError(
                f"dataset of {self.dataset_len} samples cannot fill one global batch of {self.global_batch}; "
                "lower global_batch"
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
        self._hold: tuple[int, Callable[[], None]] | None = None  # (limit, what to run before reading past it)

    @property
    def initial(self) -> tuple[int, ...]:
        return self.plans[0]

    def at(self, step: int) -> tuple[int, ...]:
        """The plan for ``step``, which from now on may not change."""
        if self._hold is not None and step > self._hold[0]:
            run, self._hold = self._hold[1], None
            run()  # a decision pending for a later step: registered before this plan is read
        if step > self.last_read:
            self.last_read = step
        return self.plans[bisect.bisect_right(self.starts, step) - 1]  # :meth:`peek`, inline (every step, twice)

    def hold(self, limit: int | None, before: Callable[[], None] | None = None) -> None:
        """Run ``before()`` once, before any plan past step ``limit`` is read (None: no hold). The session's
        meetings are read a step later; a loop that samples further ahead meanwhile reads the pending one first."""
        self._hold = None if limit is None or before is None else (int(limit), before)

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
