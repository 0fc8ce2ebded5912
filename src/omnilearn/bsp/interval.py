"""Where ranks meet: the end of a control interval, and the check that all ranks are at the same point.

Every collective of the session starts with :func:`meet`: one all-gather of
a short row per rank, ``[kind, steps_done, last step sampled, stop, cap, step_s, reset, plan, *window, *rows]``
(:func:`~omnilearn.decisions.table_row`; ``stop``: this rank got a stop
signal, any rank's makes every rank stop at this interval's end; ``cap``:
this rank's largest batch, 0 for none beyond the config's, lowered after an
out-of-memory error; ``step_s``: the median wall time of its steps in the
window, the measured objective; ``reset``: this rank reset DDP's reducer
alone after an out-of-memory redo, any rank's makes every rank reset it after
this step, :class:`~omnilearn.bsp.memory.ReducerResets`; ``plan``: the CRC of
this rank's batch plan from this step on and its lag,
:func:`~omnilearn.decisions.plan_checksum`), and at the end of the row
this rank's replica fingerprint (:mod:`omnilearn.bsp.replicas`: two
numbers, at a window's end and at ``sync_buffers()``; zeros elsewhere).
All ranks must be at the same kind of point after the same number of steps;
if one rank calls ``sync_buffers()`` while another ends a control interval,
every rank that meets raises the same clear error instead of pairing
unrelated collectives. A rank whose plan differs from rank 0's (it would
read slices that overlap or leave gaps) makes every rank raise an error
naming it, at the first window meeting after the plans parted; so does a
rank whose model replica parted from rank 0's.

:class:`Meeting` starts the all-gather and :meth:`Meeting.table` reads it:
the session reads a window's meeting one step later
(:class:`~omnilearn.bsp.steppers.IntervalEnds`). A window's meeting also
carries this rank's step rows (``rows``, 8 numbers a step: what rank 0's
record sums per step over the ranks, :meth:`Meeting.rows`), so the record's
totals need no collective of their own: a window costs one all-gather,
started at its last step and read at the next. Every meeting of a session
has room for ``slots`` rows (its control interval, the longest window), so
all meetings are alike in size: ranks at different points of the loop still
exchange rows and are told, instead of failing inside the backend.

At a control interval the row carries this rank's
:func:`~omnilearn.balance.loop.window_row` (its ``compute_s`` at its current
planned batch), so the same all-gather (``n x 12`` numbers, whatever the
interval's length) feeds the :class:`~omnilearn.balance.loop.ControlLoop` on
every rank and all reach the same decision. Between interval ends, every
:func:`check_every` steps (a third of the interval) :func:`window_meeting` gathers the same row for the
steps since the last check: if the loop sees a clear speed shift in it
(:meth:`~omnilearn.balance.loop.ControlLoop.shifted`), it decides there and
then instead of waiting for the interval's end. A change lands at the loop's
effective step, or later if some rank already sampled that step (a loop or
a ``DataLoader`` that fetches ahead): the first step no rank has sampled.

Before any of this, :func:`check_same_settings` compares the settings all
ranks must share (:func:`~omnilearn.config.shared_settings`: not paths, not
the device) and names the ones that differ; when the data starts,
:func:`agree_on_data` (one all-gather of two numbers) refuses data sources
of different sizes and gives every rank the deepest prefetch of any rank, so
all plan changes with the same lag (a rank with fewer loader workers or a
smaller prefetch factor would otherwise register a change for another step
near the run's end).

Run: ``python -m pytest -q tests/dist/test_api.py tests/dist/test_bsp.py``
"""

from __future__ import annotations

import json
import zlib
from typing import Sequence

import numpy as np

from omnilearn.balance.loop import WINDOW_FIELDS, ControlLoop
from omnilearn.bsp import replicas
from omnilearn.config import BalanceConfig, ConfigError, shared_settings
from omnilearn.data.schedule import BatchSchedule
from omnilearn.decisions import CHECK, INTERVAL, SYNC_BUFFERS, plan_checksum, plans_differ, summarise, table_row
from omnilearn.distributed.collect import RowGathering, all_gather_row, disagreements
from omnilearn.distributed.group import DistContext
from omnilearn.observe.rankrows import ROW_NAMES

ROW_WIDTH = len(ROW_NAMES)

POINTS = {INTERVAL: "the end of a control interval", SYNC_BUFFERS: "sync_buffers() (or finish())",
          CHECK: "a check within a control interval"}
SETTINGS_SLOTS = 128  # fingerprints compared at start: one for the names, one per setting (the rest folded)


def check_same_settings(ctx: DistContext, cfg: BalanceConfig, total_steps: int | None) -> None:
    """Raise on every rank unless all ranks share :func:`~omnilearn.config.shared_settings` and ``total_steps``."""
    shared = {**shared_settings(cfg), "total_steps": total_steps}
    names = sorted(shared)
    crc = [zlib.crc32(json.dumps(shared[k], sort_keys=True).encode()) for k in names]
    values = [zlib.crc32(json.dumps(names).encode()), *crc[: SETTINGS_SLOTS - 2],
              zlib.crc32(json.dumps(crc[SETTINGS_SLOTS - 2 :]).encode())]
    values += [0] * (SETTINGS_SLOTS - len(values))
    bad = disagreements(ctx, values)
    if not bad:
        return
    said = "; ".join(f"rank {r}: " + ("another set of settings" if 0 in pos else
                                      ", ".join(names[i - 1] if i < SETTINGS_SLOTS - 1 else "others" for i in pos))
                     for r, pos in bad.items())
    raise RuntimeError(f"ranks were started with settings other than rank 0's ({said}); launch every rank alike "
                       "(paths, the device and console settings may differ)")


def agree_on_data(ctx: DistContext, size: int, prefetch_batches: int, what: str = "dataset") -> int:
    """The deepest ``prefetch_batches`` of any rank; raises on every rank unless all read ``size`` samples."""
    table = all_gather_row(ctx, [size, prefetch_batches])
    sizes = [int(row[0]) for row in table]
    if len(set(sizes)) > 1:
        ranks: dict[int, list[int]] = {}
        for rank, n in enumerate(sizes):
            ranks.setdefault(n, []).append(rank)
        said = "; ".join(f"{n} on ranks {r}" for n, r in ranks.items())
        raise ConfigError(f"the ranks' {what}s differ in size ({said}): every rank must read the same {what} "
                          "(each takes its slice of every global batch from it)")
    return max(int(row[1]) for row in table)


class Meeting:
    """One meeting's all-gather, started now; :meth:`table` waits for it and checks that every rank came to the
    same point with the same plan (else raises on every rank, see :func:`meet`). ``rows``: this rank's step rows,
    carried along (every rank sends as many)."""

    def __init__(self, ctx: DistContext, kind: int, steps_done: int, last_read: int = -1,
                 window: Sequence[float] = (0.0,) * WINDOW_FIELDS, stop: bool = False, cap: int | None = None,
                 step_s: float = 0.0, reset: bool = False, plan: int = 0,
                 rows: Sequence[Sequence[float]] = (), slots: int = 0,
                 fingerprint: Sequence[float] = replicas.NONE) -> None:
        self.ctx, self.kind, self.steps_done = ctx, kind, steps_done
        if len(rows) > slots:
            raise ValueError(f"a meeting with room for {slots} step rows was given {len(rows)}")
        head = table_row(kind, steps_done, last_read, window, stop, cap, step_s, reset, plan)
        self.width, self.full = len(head), None
        # the head, the row count, the rows, zeros to the slots, the replica fingerprint
        row = np.zeros(len(head) + 1 + ROW_WIDTH * slots + replicas.WIDTH)
        row[: self.width], row[self.width], row[-replicas.WIDTH :] = head, len(rows), fingerprint
        if len(rows):
            row[self.width + 1 : self.width + 1 + ROW_WIDTH * len(rows)] = np.asarray(rows, dtype=np.float64).ravel()
        try:
            self.gathering = RowGathering(ctx, row)
        except RuntimeError as e:
            raise self._absent(e) from e

    def _absent(self, e: Exception) -> RuntimeError:
        said = str(e).splitlines()[0][:200]
        return RuntimeError(f"rank {self.ctx.rank} waited at {POINTS.get(self.kind, self.kind)} after "
                            f"{self.steps_done} steps and the other ranks did not come: call step(), sync_buffers() "
                            f"and finish() on every rank at the same points of the loop ({said})")

    def rows(self) -> list[list[list[float]]]:
        """Every rank's step rows, as sent (after :meth:`table`)."""
        first = self.width + 1
        return [row[first : first + ROW_WIDTH * int(row[self.width])].reshape(-1, ROW_WIDTH).tolist()
                for row in self.full]

    def table(self) -> list[list[float]]:
        try:
            self.full = self.gathering.array()
        except RuntimeError as e:
            raise self._absent(e) from e
        table = self.full[:, : self.width].tolist()
        kind, steps_done = self.kind, self.steps_done
        where = [(int(row[0]), int(row[1])) for row in table]
        if len(set(where)) > 1:
            groups: dict[tuple[int, int], list[int]] = {}
            for rank, w in enumerate(where):
                groups.setdefault(w, []).append(rank)
            said = "; ".join(f"ranks {ranks} at {POINTS.get(k, k)} after {s} steps" for (k, s), ranks in groups.items())
            raise RuntimeError(f"ranks are out of step: {said}. Call step(), sync_buffers() and finish() on every rank "
                               "at the same points of the loop")
        differ = plans_differ(table)
        if differ:
            raise RuntimeError(f"ranks {differ} hold a batch plan other than rank 0's at {POINTS.get(kind, kind)} "
                               f"after {steps_done} steps (their slices of the global batch would overlap or leave "
                               "gaps): start every rank with the same settings, data and checkpoint, and change plans "
                               "only through the session")
        parted = replicas.parted(self.full[:, -replicas.WIDTH :].tolist())
        if parted:
            raise replicas.parted_error(parted, f"{POINTS.get(kind, kind)} after {steps_done} steps")
        return table


def meet(ctx: DistContext, kind: int, steps_done: int, last_read: int = -1,
         window: Sequence[float] = (0.0,) * WINDOW_FIELDS, stop: bool = False, cap: int | None = None,
         step_s: float = 0.0, reset: bool = False, plan: int = 0, slots: int = 0,
         fingerprint: Sequence[float] = replicas.NONE) -> list[list[float]]:
    """All ranks' rows; raises on every rank if they are not at the same point or hold different plans.

    A rank that never comes (it skipped the call and waits in a training
    step's gradient sync instead) leaves this rank waiting until the process
    group's timeout; the error then says so.
    """
    return Meeting(ctx, kind, steps_done, last_read, window, stop, cap, step_s, reset, plan, slots=slots,
                   fingerprint=fingerprint).table()


def window_meeting(ctx: DistContext, loop: ControlLoop, schedule: BatchSchedule, kind: int, step: int,
                   steps_done: int, rows: list[list[float]], stop: bool = False, cap: int | None = None,
                   reset: bool = False, summarised: int | None = None, slots: int = 0,
                   fingerprint: Sequence[float] = replicas.NONE) -> Meeting:
    """Start the meeting of a window that ended at ``step`` (``kind``: INTERVAL or CHECK); ``rows``: this rank's
    rows of the window so far, sent along; the loop's summary is of the last ``summarised`` of them (all: None)."""
    mine, step_s = summarise(loop, ctx.rank, rows if summarised is None else rows[-summarised:])
    return Meeting(ctx, kind, steps_done, schedule.last_read, mine, stop, cap, step_s, reset,
                   plan_checksum(schedule, step, loop.lag), rows, slots, fingerprint)
