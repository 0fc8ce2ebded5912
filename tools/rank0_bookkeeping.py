"""Rank 0's bookkeeping per control interval, timed in-process with modelled ranks' rows (issue 23, part 2).

What rank 0 does at every interval end of a BSP run, after the one all-gather, with ``n`` ranks: the
ControlLoop's decision on the gathered ``n x 12`` table (:func:`omnilearn.decisions.feed`, every rank does the
same) and the record of the interval, two ways, side by side on the same rows:

- "all rows": rank 0 handles every rank's rows (:meth:`omnilearn.observe.recorder.Telemetry.interval`: one
  ``step`` event per rank per step, the per-step totals). This is what rank 0 did before issue 23's change, and
  what TensorFlow's worker 0 still does.
- "now": the session's way. Rank 0 writes its own rows (:class:`~omnilearn.observe.rankrows.RankRows`, as
  every rank does) and records the per-step totals that two reductions bring
  (:meth:`~omnilearn.observe.recorder.Telemetry.window`); the reductions' inputs are computed outside the
  timing, as they arrive from ``dist.reduce``.

Fed modelled rows (no processes, no collectives), on run directories in a temporary folder. A benchmark, not a
test: it prints milliseconds per interval and per step.

    python tools/rank0_bookkeeping.py [--ranks 4 1024 4096] [--intervals 20] [--interval 15]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from omnilearn.balance.windows import window_row
from omnilearn.config import BalanceConfig
from omnilearn.data.schedule import BatchSchedule
from omnilearn.decisions import INTERVAL, feed, make_loop, table_row
from omnilearn.observe.rankrows import RankRows, Totals, partials
from omnilearn.observe.recorder import Telemetry
from omnilearn.runplan import plan_run


def measure(n: int, intervals: int, interval: int, seed: int = 0) -> tuple[float, float, float]:
    """Ms per interval at ``n`` ranks: deciding, recording all rows, recording now."""
    rng = np.random.default_rng(seed)
    cfg = BalanceConfig(workers=n, speeds=",".join(["1"] * n), global_batch=64 * n, control_interval=interval,
                        quiet=True)
    total = intervals * interval
    run = plan_run(cfg, 64 * n * total, total, 0, warn=False)
    loop = make_loop(cfg, n, total)
    schedule = BatchSchedule(loop.batches)
    speed = rng.uniform(0.5, 2.0, n)  # a heterogeneous cluster: seconds per sample differ per rank
    decide_s = all_s = now_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("all", "now"):
            (Path(tmp) / name).mkdir()
        telemetry = Telemetry(cfg, run, Path(tmp) / "all")
        session_way = Telemetry(cfg, run, Path(tmp) / "now", own_rows=True)
        own = RankRows(0, run.steps_per_epoch, Path(tmp) / "now")
        for k in range(intervals):
            first = k * interval
            batches = schedule.at(first)
            compute = [[1e-4 * b / speed[r] * (1 + 0.05 * rng.standard_normal()) for _ in range(interval)]
                       for r, b in enumerate(batches)]
            step_s = max(max(c) for c in compute)
            rows = [[[first + s, b, compute[r][s], step_s - compute[r][s], step_s, 2.3, 0.0, 0.1]
                     for s in range(interval)] for r, b in enumerate(batches)]
            table = [table_row(INTERVAL, first + interval, first + interval, window_row(b, compute[r]), step_s=step_s)
                     for r, b in enumerate(batches)]
            start = time.perf_counter()
            decision = feed(loop, schedule, first + interval - 1, table)
            decide_s += time.perf_counter() - start
            start = time.perf_counter()
            telemetry.interval(rows, decision, first + interval)
            all_s += time.perf_counter() - start
            parts = [partials(r) for r in rows]  # each rank's; dist.reduce sums and maximises them
            summed, maxed = np.sum([p[0] for p in parts], axis=0), np.max([p[1] for p in parts], axis=0)
            start = time.perf_counter()
            own.add(rows[0])
            totals = Totals.of([int(r[0]) for r in rows[0]], summed, maxed, n, cfg.global_batch)
            session_way.window(totals, decision, first + interval)
            now_s += time.perf_counter() - start
        own.close()
    return 1e3 * decide_s / intervals, 1e3 * all_s / intervals, 1e3 * now_s / intervals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 1024, 4096])
    p.add_argument("--intervals", type=int, default=20)
    p.add_argument("--interval", type=int, default=15, help="steps per control interval (default 15)")
    args = p.parse_args()
    print("| ranks | decide ms/interval | record, all rows: ms/interval | ms/step | record now: ms/interval "
          "| ms/step |")
    print("|---|---|---|---|---|---|")
    for n in args.ranks:
        decide, before, now = measure(n, args.intervals, args.interval)
        print(f"| {n} | {decide:.2f} | {before:.1f} | {before / args.interval:.2f} | {now:.2f} | "
              f"{now / args.interval:.3f} |")


if __name__ == "__main__":
    main()
