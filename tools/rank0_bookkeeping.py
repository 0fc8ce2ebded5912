"""Rank 0's bookkeeping per control interval, timed in-process with modelled ranks' rows (issue 23, part 2).

What rank 0 does at every interval end of a BSP run, after the one all-gather, with ``n`` ranks: the
ControlLoop's decision on the gathered ``n x 12`` table (:func:`omnilearn.decisions.feed`) and the record of
the interval (:meth:`omnilearn.observe.recorder.Telemetry.interval`: one ``step`` event per rank per step into
``metrics.jsonl``, the per-step statistics). Fed modelled rows (no processes, no collectives), on a run
directory in a temporary folder. A benchmark, not a test: it prints milliseconds per interval and per step.

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
from omnilearn.observe.recorder import Telemetry
from omnilearn.runplan import plan_run


def measure(n: int, intervals: int, interval: int, seed: int = 0) -> tuple[float, float]:
    """(ms per interval deciding, ms per interval recording) at ``n`` ranks."""
    rng = np.random.default_rng(seed)
    cfg = BalanceConfig(workers=n, speeds=",".join(["1"] * n), global_batch=64 * n, control_interval=interval,
                        quiet=True)
    total = intervals * interval
    run = plan_run(cfg, 64 * n * total, total, 0, warn=False)
    loop = make_loop(cfg, n, total)
    schedule = BatchSchedule(loop.batches)
    speed = rng.uniform(0.5, 2.0, n)  # a heterogeneous cluster: seconds per sample differ per rank
    decide_s = record_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        telemetry = Telemetry(cfg, run, Path(tmp))
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
            record_s += time.perf_counter() - start
    return 1e3 * decide_s / intervals, 1e3 * record_s / intervals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 1024, 4096])
    p.add_argument("--intervals", type=int, default=20)
    p.add_argument("--interval", type=int, default=15, help="steps per control interval (default 15)")
    args = p.parse_args()
    print("| ranks | decide ms/interval | record ms/interval | record ms/step | record µs/step/rank |")
    print("|---|---|---|---|---|")
    for n in args.ranks:
        decide, record = measure(n, args.intervals, args.interval)
        print(f"| {n} | {decide:.2f} | {record:.1f} | {record / args.interval:.2f} | "
              f"{1e3 * record / args.interval / n:.1f} |")


if __name__ == "__main__":
    main()
