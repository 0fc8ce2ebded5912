"""Asynchronous (ASP) training rules: data dealing, coverage, learning-rate scaling, staleness, liveness. Pure Python.

The parameter server hands out data and applies gradients one push at a
time. :class:`IndexDealer` deals the next ``b_i`` indices of the epoch's
global permutation to whichever worker asks, so every sample is used exactly
once per epoch however fast each worker is (the epoch's last batch may be
short). Indices dealt to a worker that is then dropped (dead or silent) are
given back with :meth:`IndexDealer.take_back` and dealt again, first, to the
others, still tagged with their own epoch. :class:`Coverage` is the check:
per data epoch, which samples the server applied and how many applications
were repeats. :func:`push_lr` is the rate a push is applied with: linear
scaling ``lr * b / b_ref`` (``b_ref = B / n``, so a balanced push moves the
model as much as a uniform one) and, optionally, divided by the push's
staleness (Zhang et al. 2016). :class:`Staleness` keeps per-worker
statistics. :class:`Liveness` knows which workers have spoken and how long
each may stay silent (the server's listeners time the silence, and drop a
hung worker past it; the server's training time is
:class:`omnilearn.clocks.train.TrainClock`). Every stateful class has
``state_dict()``/``load_state_dict()`` of plain values (checkpoints load with
``weights_only=True``).

Run its tests: ``python -m pytest -q tests/unit/test_aspmath.py``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

LR_SCALINGS = ("linear", "none")


@dataclass
class IndexDealer:
    """Deals consecutive slices of one seeded permutation per epoch (epoch ``e``: seed ``(seed, e)``).

    ``returned``: ``(epoch, indices)`` taken back from dropped workers, oldest epoch first; dealt before
    any new index, a batch never mixing epochs.
    """

    dataset_len: int
    seed: int = 0
    epoch: int = 0
    cursor: int = 0
    returned: list[tuple[int, list[int]]] = field(default_factory=list)
    _perm: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dataset_len < 1:
            raise ValueError("cannot deal from an empty dataset")

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.dataset_len)
        return self._perm

    def deal(self, batch: int) -> tuple[int, list[int]]:
        """(epoch, indices): taken-back ones first, else the next ``min(batch, left in epoch)`` of the epoch."""
        if batch < 1:
            raise ValueError(f"batch {batch} must be at least 1")
        if self.returned:
            epoch, indices = self.returned[0]
            if len(indices) > batch:
                self.returned[0] = (epoch, indices[batch:])
            else:
                self.returned.pop(0)
            return epoch, indices[:batch]
        if self.cursor >= self.dataset_len:
            self.epoch, self.cursor, self._perm = self.epoch + 1, 0, None
        perm = self._permutation()
        taken = perm[self.cursor : self.cursor + batch].tolist()
        self.cursor += len(taken)
        return self.epoch, taken

    def take_back(self, epoch: int, indices: Sequence[int]) -> None:
        """Deal ``indices`` of ``epoch`` again (their worker never pushed them), before any new ones."""
        if epoch > self.epoch or epoch < 0:
            raise ValueError(f"cannot take back indices of epoch {epoch}: the dealer is at epoch {self.epoch}")
        if len(indices):
            self.returned.append((int(epoch), [int(i) for i in indices]))
            self.returned.sort(key=lambda item: item[0])  # stable: the oldest epoch is completed first

    @property
    def queued(self) -> int:
        """Indices taken back and not yet dealt again."""
        return sum(len(indices) for _, indices in self.returned)

    @property
    def dealt(self) -> int:
        """Samples handed out and not taken back, over all epochs."""
        return self.epoch * self.dataset_len + self.cursor - self.queued

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.cursor / self.dataset_len

    def state_dict(self, pending: Iterable[tuple[int, Sequence[int]]] = ()) -> dict:
        """The position, as if the ``pending`` deals (``(epoch, indices)`` still at workers) were taken back."""
        returned = sorted([(e, list(i)) for e, i in self.returned] + [(int(e), [int(x) for x in i])
                                                                      for e, i in pending if len(i)],
                          key=lambda item: item[0])
        return {"dataset_len": self.dataset_len, "seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "returned": [[e, i] for e, i in returned]}

    def load_state_dict(self, state: dict) -> None:
        if (state["dataset_len"], state["seed"]) != (self.dataset_len, self.seed):
            raise ValueError(f"dealer state of {state['dataset_len']} samples with seed {state['seed']} does not fit "
                             f"{self.dataset_len} samples with seed {self.seed}: same dataset and --seed needed")
        self.epoch, self.cursor, self._perm = int(state["epoch"]), int(state["cursor"]), None
        self.returned = [(int(e), [int(x) for x in i]) for e, i in state["returned"]]


class Coverage:
    """Per data epoch: samples applied, which ones (until all were), and repeats: the exactly-once check.

    ``applied[e]`` counts the samples of epoch ``e`` in applied pushes; ``repeats`` counts applications of
    a sample already applied in the same epoch (0 in a correct run). An epoch is *complete* once every
    sample was applied; its bitmap (one bit per sample) is then freed, so memory holds the open epochs only.
    """

    def __init__(self, dataset_len: int) -> None:
        self.dataset_len = dataset_len
        self.applied: list[int] = []
        self.repeats = 0
        self.open: dict[int, np.ndarray] = {}  # epoch -> bool per sample (applied yet)

    def add(self, epoch: int, indices: Sequence[int]) -> None:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.dataset_len):
            raise ValueError(f"indices outside 0..{self.dataset_len - 1} in epoch {epoch}")
        done = self.complete(epoch)
        self.applied.extend([0] * (epoch + 1 - len(self.applied)))
        self.applied[epoch] += idx.size
        if done:
            self.repeats += idx.size
            return
        seen = self.open.setdefault(epoch, np.zeros(self.dataset_len, dtype=bool))
        fresh = np.unique(idx)
        fresh = fresh[~seen[fresh]]
        self.repeats += idx.size - fresh.size
        seen[fresh] = True
        if seen.all():
            del self.open[epoch]

    def complete(self, epoch: int) -> bool:
        return epoch < len(self.applied) and self.applied[epoch] > 0 and epoch not in self.open

    def summary(self) -> dict:
        return {"samples_per_epoch": list(self.applied), "repeated_samples": self.repeats,
                "complete_epochs": [e for e in range(len(self.applied)) if self.complete(e)]}

    def state_dict(self) -> dict:
        return {"dataset_len": self.dataset_len, "applied": list(self.applied), "repeats": self.repeats,
                "open": {e: np.packbits(seen).tobytes() for e, seen in self.open.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["dataset_len"] != self.dataset_len:
            raise ValueError(f"coverage of {state['dataset_len']} samples loaded for {self.dataset_len}")
        self.applied, self.repeats = [int(a) for a in state["applied"]], int(state["repeats"])
        self.open = {int(e): np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=self.dataset_len).astype(bool)
                     for e, bits in state["open"].items()}


def push_lr(base_lr: float, batch: int, b_ref: float, staleness: int, scaling: str, staleness_aware: bool) -> float:
    """The learning rate one push is applied with."""
    if scaling not in LR_SCALINGS:
        raise ValueError(f"unknown lr scaling {scaling!r}; choose one of {', '.join(LR_SCALINGS)}")
    lr = base_lr * batch / b_ref if scaling == "linear" else base_lr
    return lr / max(1, staleness) if staleness_aware else lr


@dataclass
class Staleness:
    """Per-worker push counts and staleness (server version at apply time minus the pulled version).

    Each worker's staleness values are counted per value (a histogram: staleness is a small integer), so the
    quantiles (:meth:`quantile`: p50, p99) are exact at O(1) per push. ``refused``: pushes refused for staleness
    above the bound (``--max-staleness``; :func:`over_bound`).
    """

    workers: int
    counts: list[int] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    maxima: list[int] = field(default_factory=list)
    hist: list[dict[int, int]] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts, self.totals, self.maxima = [0] * self.workers, [0] * self.workers, [0] * self.workers
        self.hist, self.refused = [{} for _ in range(self.workers)], [0] * self.workers

    def of(self, worker: int, server_version: int, pulled_version: int) -> int:
        """A push's staleness (no record)."""
        if pulled_version > server_version:
            raise ValueError(f"worker {worker} pushed for version {pulled_version}, newer than the server's "
                             f"{server_version}")
        return server_version - pulled_version

    def record(self, worker: int, server_version: int, pulled_version: int) -> int:
        s = self.of(worker, server_version, pulled_version)
        self.counts[worker] += 1
        self.totals[worker] += s
        self.maxima[worker] = max(self.maxima[worker], s)
        self.hist[worker][s] = self.hist[worker].get(s, 0) + 1
        return s

    def mean(self, worker: int) -> float:
        return self.totals[worker] / self.counts[worker] if self.counts[worker] else 0.0

    def quantile(self, q: float, worker: int | None = None) -> int:
        """The smallest staleness with at least ``q`` of the pushes at or below it (one worker's, or all)."""
        merged: dict[int, int] = {}
        for h in self.hist if worker is None else [self.hist[worker]]:
            for value, count in h.items():
                merged[value] = merged.get(value, 0) + count
        total = sum(merged.values())
        if not total:
            return 0
        seen = 0
        for value in sorted(merged):
            seen += merged[value]
            if seen >= q * total:
                return value
        return max(merged)  # pragma: no cover - q <= 1 always returns above

    def state_dict(self) -> dict:
        return {"counts": list(self.counts), "totals": list(self.totals), "maxima": list(self.maxima),
                "hist": [[[v, c] for v, c in sorted(h.items())] for h in self.hist], "refused": list(self.refused)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; an older state without the histogram or refusals loads them empty."""
        if len(state["counts"]) != self.workers:
            raise ValueError(f"staleness of {len(state['counts'])} workers loaded for {self.workers}")
        self.counts, self.totals, self.maxima = ([int(v) for v in state[k]] for k in ("counts", "totals", "maxima"))
        self.hist = [{int(v): int(c) for v, c in h} for h in state.get("hist", [[] for _ in range(self.workers)])]
        self.refused = [int(v) for v in state.get("refused", [0] * self.workers)]


def over_bound(staleness: int, bound: int | None, retried: bool) -> bool:
    """Refuse this push (the worker recomputes the same samples on fresh weights)?

    Above the bound, once per batch dealt: a one-off stall (a host hiccup) costs one recomputation instead of an
    update ``staleness`` versions old; a worker slower than the bound allows every time is not starved (its
    recomputed push is applied whatever its staleness, and counted).
    """
    return bound is not None and staleness > bound and not retried


@dataclass
class Liveness:
    """Which workers have spoken, and how long each may stay silent.

    Before its first request a worker may take ``timeout_s`` (start-up: data, model); after it,
    ``heartbeat_s`` (capped at ``timeout_s``; None: ``timeout_s``). The silence itself is timed by the
    worker's listener at the server (:mod:`omnilearn.distributed.serverlink`), from its last answer.
    """

    workers: int
    timeout_s: float
    heartbeat_s: float | None = None
    greeted: list[bool] = field(default_factory=list)

    def start(self) -> None:
        self.greeted = [False] * self.workers

    def heard(self, worker: int) -> None:
        self.greeted[worker] = True

    def allowance_s(self, worker: int) -> float:
        beat = self.timeout_s if self.heartbeat_s is None else min(self.heartbeat_s, self.timeout_s)
        return beat if self.greeted[worker] else self.timeout_s
