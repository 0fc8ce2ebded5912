"""Asynchronous (ASP) training rules: data dealing, learning-rate scaling, staleness, liveness. Pure Python.

The parameter server hands out data and applies gradients one push at a
time. :class:`IndexDealer` deals the next ``b_i`` indices of the epoch's
global permutation to whichever worker asks, so every sample is used exactly
once per epoch however fast each worker is (the epoch's last batch may be
short). :func:`push_lr` is the rate a push is applied with: linear scaling
``lr * b / b_ref`` (``b_ref = B / n``, so a balanced push moves the model as
much as a uniform one) and, optionally, divided by the push's staleness
(Zhang et al. 2016). :class:`Staleness` keeps per-worker statistics.
:class:`Liveness` knows when each worker was last heard from, so the server
can name one silent for longer than the timeout (the server's training time
is :class:`omnilearn.trainclock.TrainClock`).

Run its tests: ``python -m pytest -q tests/unit/test_aspmath.py``
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

LR_SCALINGS = ("linear", "none")


@dataclass
class IndexDealer:
    """Deals consecutive slices of one seeded permutation per epoch (epoch ``e``: seed ``(seed, e)``)."""

    dataset_len: int
    seed: int = 0
    epoch: int = 0
    cursor: int = 0
    _perm: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dataset_len < 1:
            raise ValueError("cannot deal from an empty dataset")

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.dataset_len)
        return self._perm

    def deal(self, batch: int) -> tuple[int, list[int]]:
        """(epoch, indices): the next ``min(batch, left in epoch)`` indices; a new epoch starts when one is used up."""
        if batch < 1:
            raise ValueError(f"batch {batch} must be at least 1")
        if self.cursor >= self.dataset_len:
            self.epoch, self.cursor, self._perm = self.epoch + 1, 0, None
        perm = self._permutation()
        taken = perm[self.cursor : self.cursor + batch].tolist()
        self.cursor += len(taken)
        return self.epoch, taken

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.cursor / self.dataset_len


def push_lr(base_lr: float, batch: int, b_ref: float, staleness: int, scaling: str, staleness_aware: bool) -> float:
    """The learning rate one push is applied with."""
    if scaling not in LR_SCALINGS:
        raise ValueError(f"unknown lr scaling {scaling!r}; choose one of {', '.join(LR_SCALINGS)}")
    lr = base_lr * batch / b_ref if scaling == "linear" else base_lr
    return lr / max(1, staleness) if staleness_aware else lr


@dataclass
class Staleness:
    """Per-worker push counts and staleness (server version at apply time minus the pulled version)."""

    workers: int
    counts: list[int] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    maxima: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts, self.totals, self.maxima = [0] * self.workers, [0] * self.workers, [0] * self.workers

    def record(self, worker: int, server_version: int, pulled_version: int) -> int:
        if pulled_version > server_version:
            raise ValueError(f"worker {worker} pushed for version {pulled_version}, newer than the server's "
                             f"{server_version}")
        s = server_version - pulled_version
        self.counts[worker] += 1
        self.totals[worker] += s
        self.maxima[worker] = max(self.maxima[worker], s)
        return s

    def mean(self, worker: int) -> float:
        return self.totals[worker] / self.counts[worker] if self.counts[worker] else 0.0


@dataclass
class Liveness:
    """When each worker was last heard from (server clock, seconds); which one is silent past ``timeout_s``."""

    workers: int
    timeout_s: float
    last_heard_s: list[float] = field(default_factory=list)

    def start(self, now_s: float) -> None:
        self.last_heard_s = [now_s] * self.workers

    def heard(self, worker: int, now_s: float) -> None:
        self.last_heard_s[worker] = now_s

    def quietest(self, now_s: float, done: set[int]) -> tuple[int, float] | None:
        """(worker, seconds silent) of the longest-silent worker not in ``done``; None when all are done."""
        live = [(self.last_heard_s[w], w) for w in range(self.workers) if w not in done]
        if not live:
            return None
        heard_s, worker = min(live)
        return worker, now_s - heard_s

    def silent(self, now_s: float, done: set[int]) -> tuple[int, float] | None:
        """The quietest worker when it has been silent for longer than ``timeout_s``, else None."""
        found = self.quietest(now_s, done)
        return found if found is not None and found[1] > self.timeout_s else None
