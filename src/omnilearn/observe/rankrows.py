"""Each rank's own part of BSP's record: its step rows in its own file, its sums; rank 0 gets totals only.

Rank 0's files and console do not grow with the number of workers:

- every rank writes its own step rows (:data:`~omnilearn.observe.recorder.ROW_FIELDS`,
  plus ``epoch`` and ``rank``) as ``step`` events to ``RUN_DIR/steps/rank-<r>.jsonl``
  (:class:`RankRows`), once per control interval;
- every rank keeps its own per-step sums (batch, compute, wait) for the
  summary's per-worker means, gathered to rank 0 once, at the end;
- rank 0 totals each window per step (:meth:`Totals.of_table`: a sum and a
  maximum over the ranks of :func:`partials`) from the rows the window's
  meeting carries anyway (8 numbers a step per rank, in its all-gather:
  :mod:`omnilearn.bsp.interval`), so the totals cost no collective.

A resume writes a ``resume`` event into each rank's file (and rank 0 into
the files of ranks a smaller restart no longer has: :func:`void_gone`), so
:func:`omnilearn.observe.metrics.read_rank_rows` applies the same rule as ``metrics.jsonl``'s readers
(:func:`omnilearn.observe.metrics.replay`) file by file. On several nodes
without a shared file system each node holds its own ranks' files.

Run its tests: ``python -m pytest -q tests/unit/test_recorder.py tests/unit/test_rundir.py``
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from omnilearn.observe import heldrun
from omnilearn.observe.rundir import STEPS_DIR, MetricsLog
from omnilearn.observe.suffix import SuffixStats

ROW_NAMES = ("step", "batch", "compute_s", "wait_s", "step_s", "loss", "delay_s", "lr")  # = recorder.ROW_FIELDS
SUMMED = 4  # per step, summed over ranks: batch, speed (batch / compute_s), step_s, batch * loss
_RANK_FILE = re.compile(r"rank-(\d+)\.jsonl$")


def rank_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / STEPS_DIR / f"rank-{rank}.jsonl"


class RankRows:
    """One rank's step rows and per-step sums; the rows go to :func:`rank_file` when there is a run directory."""

    def __init__(self, rank: int, steps_per_epoch: int, run_dir: Path | None) -> None:
        self.rank, self.steps_per_epoch, self.run_dir = rank, steps_per_epoch, run_dir
        self.log: MetricsLog | None = None
        self.stats = SuffixStats(("sum",) * 3)  # per step: batch, compute_s, wait_s
        self.add_s = 0.0  # time spent in add(): this rank's share of the record's cost
        self.first_written = False

    def _file(self) -> MetricsLog | None:
        if self.log is None and self.run_dir is not None:  # opened at the first write: rank 0 has made the dir
            (Path(self.run_dir) / STEPS_DIR).mkdir(parents=True, exist_ok=True)
            self.log = MetricsLog(self.run_dir, f"{STEPS_DIR}/rank-{self.rank}.jsonl")
        return self.log

    def add(self, rows: Sequence[Sequence[float]]) -> None:
        """This rank's rows of one window: written (one flush) and added to the sums."""
        start = time.perf_counter()
        if self.rank == 0 and not self.first_written:  # resumed or not, every rank has decided by now
            heldrun.drop(self.run_dir)
        self.first_written = True
        log = self._file()
        if log is not None:
            for row in rows:
                step, batch = int(row[0]), int(row[1])
                rec = dict(zip(ROW_NAMES, (step, batch, *(float(v) for v in row[2:]))))
                log.write({"event": "step", "epoch": step // self.steps_per_epoch, "rank": self.rank, **rec})
            log.flush()
        self.stats.extend([row[1:4] for row in rows])  # batch, compute_s, wait_s
        self.add_s += time.perf_counter() - start

    def resume(self, step: int) -> None:
        """A resumed run redoes steps ``step``.. : the rows an earlier attempt wrote for them are void."""
        heldrun.reclaim(self.run_dir, f"{STEPS_DIR}/rank-{self.rank}.jsonl")  # a re-run's replaced rows, back
        log = self._file()
        if log is not None:
            log.write({"event": "resume", "step": step})
            log.flush()

    def sums(self, first: int) -> list[float]:
        """Batch, compute and wait summed over this rank's recorded steps from the ``first``-th on."""
        return self.stats.since(first)

    def summary_row(self, control_interval: int) -> list[float]:
        """What the summary needs of this rank: its :meth:`sums` over the last half and the last interval."""
        count = self.stats.count
        return [*self.sums(count // 2), *self.sums(count - control_interval)]

    def close(self) -> None:
        self.stats.close()
        if self.log is not None:
            self.log.close()


def void_gone(run_dir: Path | None, workers: int, step: int) -> None:
    """Rank 0 at a resume with ``workers``: the files of ranks ``workers``.. get a ``resume`` event too."""
    for name in heldrun.held_rows(run_dir, STEPS_DIR):  # a re-run's replaced rows of ranks it no longer has
        if int(_RANK_FILE.search(name).group(1)) >= workers:
            heldrun.reclaim(run_dir, name)
    if run_dir is None or not (Path(run_dir) / STEPS_DIR).is_dir():
        return
    for path in (Path(run_dir) / STEPS_DIR).iterdir():
        m = _RANK_FILE.match(path.name)
        if m and int(m.group(1)) >= workers:
            log = MetricsLog(run_dir, f"{STEPS_DIR}/{path.name}")
            log.write({"event": "resume", "step": step})
            log.close()


# ------------------------------------------------------------ per-step totals
def partials(rows: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """One rank's contribution to a window's totals: (summed over ranks, maximised over ranks).

    For ``k`` rows: ``4k`` sums (batch, speed, step_s and batch * loss per
    step) and ``k + 1`` maxima (``-wait_s`` per step, whose maximum is minus
    the smallest wait; then the rank's mean wait over the window).
    """
    a = np.asarray(rows, dtype=np.float64).reshape(-1, len(ROW_NAMES))
    batch, compute, wait, step_s, loss = a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5]
    speed = np.divide(batch, compute, out=np.zeros_like(batch), where=compute > 0)
    summed = np.stack((batch, speed, step_s, batch * loss), axis=1).reshape(-1)
    maxed = np.concatenate((-wait, [wait.mean() if len(wait) else 0.0]))
    return summed.tolist(), maxed.tolist()


@dataclass
class Totals:
    """A window's per-step totals over all ranks (what rank 0 records), from the reduced :func:`partials`."""

    steps: list[int]
    ideal_s: list[float]  # T* = B / sum v_i + min wait
    measured_s: list[float]  # the ranks' mean step_s
    loss: list[float]  # sum batch * loss / global batch
    max_wait_s: float  # the largest of the ranks' mean waits over the window

    @classmethod
    def of(cls, steps: Sequence[int], summed: Sequence[float], maxed: Sequence[float], workers: int,
           global_batch: int) -> Totals:
        s = np.asarray(summed, dtype=np.float64).reshape(-1, SUMMED)
        m = np.asarray(maxed, dtype=np.float64)
        batch, speed, step_s, weighted = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
        ideal = batch / speed - m[:-1]
        return cls([int(v) for v in steps], ideal.tolist(), (step_s / workers).tolist(),
                   (weighted / global_batch).tolist(), float(m[-1]) if len(m) > len(steps) else 0.0)

    @classmethod
    def of_table(cls, table: Sequence[Sequence[Sequence[float]]], global_batch: int) -> Totals:
        """The same totals from every rank's rows at once (one process holds them all: TensorFlow, tests)."""
        a = np.asarray(table, dtype=np.float64).reshape(len(table), -1, len(ROW_NAMES))  # (ranks, steps, fields)
        batch, compute, wait, step_s, loss = (a[..., i] for i in range(1, 6))
        speed = np.divide(batch, compute, out=np.zeros_like(batch), where=compute > 0)
        summed = np.stack((batch, speed, step_s, batch * loss), axis=2).sum(axis=0).reshape(-1)
        maxed = np.concatenate(((-wait).max(axis=0), [wait.mean(axis=1).max() if a.shape[1] else 0.0]))
        return cls.of([int(v) for v in a[0, :, 0]], summed, maxed, len(table), global_batch)
