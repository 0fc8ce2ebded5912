"""A control window's end, shared by the runtimes: timings in, the same decision on every worker out. Pure.

Both synchronous runtimes -- PyTorch (:mod:`omnilearn.bsp`) and TensorFlow
(:mod:`omnilearn.tf`) -- build their :class:`~omnilearn.balance.loop.ControlLoop`
with :func:`make_loop` and, at the end of a control window, gather one row
per worker in the same layout (:func:`table_row`)::

    [kind, steps_done, last step sampled, stop asked, cap, median step_s, reset pending, plan crc, *window_row]

(``kind``: :data:`INTERVAL`, :data:`CHECK` or :data:`SYNC_BUFFERS`; ``reset
pending``: this worker reset DDP's reducer alone after an out-of-memory redo,
:mod:`omnilearn.bsp.memory`; ``plan crc``: :func:`plan_checksum`, 0 where a
runtime does not check it) with one collective (gloo/NCCL all-gather, or a ``tf.distribute`` SUM
all-reduce), then hand the table to :func:`feed` (the interval's end) or
:func:`check` (a look within the interval for a clear speed shift). So the
same plan fed the same timings gives the same batches in either framework:
``tests/tf/test_tf_train.py`` checks it on two real runs.

``OMNILEARN_TEST_S_PER_SAMPLE=a0:c0,a1:c1,...`` (tests only; ``c`` alone
means ``a = 0``) replaces the measured times that reach the loop by
scripted ones: worker ``i``'s compute ``a_i + c_i x batch`` and the step
the slowest worker's, so two runs see exactly the same timings whatever the
machine does.

Run: ``python -m pytest -q tests/unit/test_decisions.py tests/tf``
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from statistics import median
from typing import Sequence

from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import Decision, make_controller
from omnilearn.balance.loop import ControlLoop, window_row
from omnilearn.config import BalanceConfig
from omnilearn.data.schedule import BatchSchedule
from omnilearn.runplan import initial_speeds

INTERVAL, SYNC_BUFFERS, CHECK = 1, 2, 3  # the kinds of meeting point (CHECK: a look within an interval)
HEADER = 8  # kind, steps done, last step sampled, stop asked, cap, median step_s, reset pending, plan crc
SCRIPTED_ENV = "OMNILEARN_TEST_S_PER_SAMPLE"


def make_loop(cfg: BalanceConfig, workers: int, total_steps: int | None) -> ControlLoop:
    """The run's controller inside its loop, from the config (the same for every runtime)."""
    bounds = Bounds(cfg.global_batch, workers, cfg.min_batch, cfg.batch_caps)
    controller = make_controller(cfg.controller, bounds, initial_speeds(cfg, total_steps), cfg.batch_multiple)
    return ControlLoop(controller, deadband=cfg.deadband, total_steps=total_steps)


def scripted_times(workers: int) -> tuple[tuple[float, float], ...] | None:
    """The scripted ``(fixed_s, s_per_sample)`` of :data:`SCRIPTED_ENV` (tests), one per worker; None when unset."""
    text = os.environ.get(SCRIPTED_ENV)
    if not text:
        return None
    try:
        pairs = tuple((float(a or 0), float(c)) for a, _, c in (v.rpartition(":") for v in text.split(",")))
    except ValueError:
        pairs = ()
    if len(pairs) != workers or any(a < 0 or c <= 0 for a, c in pairs):
        raise ValueError(f"{SCRIPTED_ENV}={text!r}: give {workers} entries fixed_s:s_per_sample (or s_per_sample), "
                         "comma-separated")
    return pairs


def summarise(loop: ControlLoop, rank: int, rows: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], float]:
    """This rank's window row (its ``compute_s`` at its current planned batch) and median ``step_s`` there.

    ``rows``: this rank's step rows ``[step, batch, compute_s, wait_s, step_s, ...]``.
    """
    batch = loop.batches[rank]
    now = [r for r in rows if int(r[1]) == batch]
    scripted = scripted_times(loop.workers)
    if scripted is not None:
        times = [a + c * b for (a, c), b in zip(scripted, loop.batches)]
        return window_row(batch, [times[rank]] * len(now)), max(times) if now else 0.0
    return window_row(batch, [r[2] for r in now]), float(median([r[4] for r in now])) if now else 0.0


def table_row(kind: int, steps_done: int, last_read: int, window: Sequence[float], stop: bool = False,
              cap: int | None = None, step_s: float = 0.0, reset: bool = False, plan: int = 0) -> list[float]:
    """One worker's row of the gathered table (the layout above)."""
    return [kind, steps_done, last_read, float(stop), float(cap or 0), step_s, float(reset), float(plan), *window]


def plan_checksum(schedule: BatchSchedule, step: int, lag: int) -> int:
    """CRC-32 of what decides which samples every worker takes from ``step`` on: the plan in force at ``step``,
    every change registered after it, and the loop's lag (exact in a float64 header field)."""
    later = [(s, p) for s, p in zip(schedule.starts, schedule.plans) if s > step]
    return zlib.crc32(json.dumps([lag, schedule.peek(step), later]).encode())


def plans_differ(table: Sequence[Sequence[float]]) -> list[int]:
    """The workers whose plan checksum differs from worker 0's (none when all agree)."""
    return [rank for rank, row in enumerate(table) if row[7] != table[0][7]]


def feed(loop: ControlLoop, schedule: BatchSchedule, step: int, table: Sequence[Sequence[float]],
         read_ahead: int = 0) -> Decision:
    """Give the gathered ``table`` to the loop; register a change in ``schedule`` at the first step no rank sampled
    (``read_ahead``: how many more steps past its row's each rank may have sampled since: a meeting read later)."""
    caps = [int(row[4]) for row in table]
    decision = loop.update(step, [row[HEADER:] for row in table], caps=caps if any(caps) else None,
                           step_s=[row[5] for row in table])
    if not decision.changed:
        return decision
    first = max(decision.effective_step, 1 + read_ahead + max(int(row[2]) for row in table))
    schedule.change(first, decision.new)
    return dataclasses.replace(decision, effective_step=first)


def check(loop: ControlLoop, schedule: BatchSchedule, step: int, table: Sequence[Sequence[float]],
          read_ahead: int = 0) -> Decision | None:
    """A look within the interval: a decision (recorded) if some worker's speed clearly shifted, else None."""
    if not loop.shifted([row[HEADER:] for row in table]).any():
        return None
    return feed(loop, schedule, step, table, read_ahead)


def stop_asked(table: Sequence[Sequence[float]]) -> bool:
    """Whether any worker asked to stop (a signal): every worker stops after the same step."""
    return any(row[3] for row in table)


def reset_asked(table: Sequence[Sequence[float]]) -> bool:
    """Whether any worker has a reducer reset pending: every worker resets after this same step."""
    return any(row[6] for row in table)


def check_every(interval: int) -> int:
    """Steps between mid-interval checks for a speed shift: a third of the interval (0: none below 6 steps)."""
    return interval // 3 if interval >= 6 else 0


# A check costs a meeting (an all-gather and the loop's test: 0.1-1 ms of the training thread's host time,
# docs/results.md "The hot path"); it pays where the steps between two checks last at least this long (the
# meeting is then at most a few percent of them). Where steps are shorter, a shift waits for the interval's
# end: at most two check windows, under 0.1 s, later.
CHECK_WINDOW_MIN_S = 0.05


def checks_pay(step_s: float, every: int) -> bool:
    """Whether mid-interval checks every ``every`` steps pay for their meetings at steps of ``step_s`` (the
    last interval's: every worker reads the same gathered value, so all reach the same answer)."""
    return every > 0 and every * step_s >= CHECK_WINDOW_MIN_S


# An interval's meeting (the all-gather, the control loop's decision, the window's record: about 1-1.5 ms of the
# training thread's host time, docs/results.md "The hot path") costs at most about 1% of its window where the
# window lasts BalanceConfig.min_window_s (0.15 s by default). Where an interval's steps are shorter (a tiny
# model, a fast GPU), the next window is stretched to whole intervals, at most MAX_STRETCH of them, so the
# meetings come about that often in time instead of every interval in steps. Only once the loop has settled:
# for the run's first WARMUP_INTERVALS intervals (the controller learns the speeds) and after any decision that
# changed the plan (the loop judges the change in the next window), windows stay one interval long.
MAX_STRETCH = 8
WARMUP_INTERVALS = 4


def window_steps(step_s: float, interval: int, min_window_s: float, settled: bool = True) -> int:
    """The next window's length in steps: ``interval``, or, where the loop has ``settled`` (see above), the fewest
    whole intervals (at most :data:`MAX_STRETCH`) that last ``min_window_s`` at steps of ``step_s`` (the last
    interval's: every worker reads the same gathered value, so all reach the same length). ``min_window_s`` 0:
    always ``interval``."""
    span = interval * step_s
    if not settled or min_window_s <= 0 or not span > 0 or span >= min_window_s:  # also NaN: no step time known
        return interval
    return interval * math.ceil(min(MAX_STRETCH, min_window_s / span))


def interval_step_s(table: Sequence[Sequence[float]]) -> float:
    """The interval's step time from its gathered table: the largest worker median (the step waits for it)."""
    return max(float(row[5]) for row in table)


def settled(decision: Decision, intervals: int) -> bool:
    """Whether the next window may be stretched (:func:`window_steps`): ``intervals`` (read so far in this run, this
    one included) past the warm-up, and this interval's ``decision`` left the plan as it was."""
    return intervals >= WARMUP_INTERVALS and not decision.changed
