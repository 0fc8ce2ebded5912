"""Human output (rank 0 only), for BSP and ASP: a live progress line, rebalance notes, the final table.

On a terminal the progress line rewrites itself in place; in a log (CI, a
pipe) each update is its own line. Machine-readable output lives in the run
directory, never here. Before training, :func:`startup` says what the
launcher and rank 0 are doing (one line per start-up phase, with how long it
took: :func:`took`); :func:`warn` is the one-line ``omnilearn: warning:`` on
stderr for a run that goes on.

Run its tests: ``python -m pytest -q tests/unit/test_recorder.py``
"""

from __future__ import annotations

import sys
from typing import Any, Sequence, TextIO

from omnilearn.balance.efficiency import WorkerStats


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


BATCHES_SHOWN = 16  # more workers than this: the progress line gives the spread of their batches, not each


def _batches(batches: Sequence[int]) -> str:
    if len(batches) <= BATCHES_SHOWN:
        return "/".join(str(b) for b in batches)
    ordered = sorted(batches)
    return f"{ordered[0]}..{ordered[len(ordered) // 2]}..{ordered[-1]} (min..median..max of {len(ordered)})"


def took(seconds: float) -> str:
    """A phase's duration for a start-up line: ``0.03 s``, ``2.3 s``, ``41 s``."""
    return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def startup(text: str, quiet: bool = False, stream: TextIO | None = None) -> None:
    """One start-up progress line, ``omnilearn: <text>``, flushed at once; nothing when ``quiet``.

    Call it from the launcher or rank 0 only, once per start-up phase.
    """
    Console(stream, quiet).line(f"omnilearn: {text}")


def warn(text: str, stream: TextIO | None = None) -> None:
    """``omnilearn: warning: <text>`` as one line on stderr (the run goes on); printed even when quiet."""
    out = stream or sys.stderr
    out.write(f"omnilearn: warning: {' '.join(text.split())}\n")
    out.flush()


class Console:
    def __init__(self, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.quiet = quiet  # only info() lines
        self._open_line = False

    def _emit(self, text: str, transient: bool = False) -> None:
        if self.quiet:
            return
        if self.live and transient:
            self.stream.write("\r\033[K" + text)
            self._open_line = True
        else:
            if self._open_line:
                self.stream.write("\r\033[K")
            self.stream.write(text + "\n")
            self._open_line = False
        self.stream.flush()

    def line(self, text: str, transient: bool = False) -> None:
        """A progress line (``transient``: rewritten in place on a terminal); nothing when quiet."""
        self._emit(text, transient)

    def info(self, text: str) -> None:
        if self._open_line:
            self.stream.write("\r\033[K")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def progress(self, step: int, total: int | str, epoch: int, loss: float, batches: Sequence[int],
                 step_s: float, ideal_s: float, max_wait_s: float) -> None:
        self._emit(
            f"step {step:>5}/{total} | epoch {epoch:>3} | loss {loss:.4f} | batches {_batches(batches)} | "
            f"step {_ms(step_s)} ms (ideal {_ms(ideal_s)}) | max wait {_ms(max_wait_s)} ms",
            transient=True,
        )

    def rebalance(self, step: int, effective: int, old: Sequence[int], new: Sequence[int],
                  times_s: Sequence[float]) -> None:
        if len(times_s) <= BATCHES_SHOWN:
            times = "/".join(_ms(t) for t in times_s)
        else:
            ordered = sorted(times_s)
            times = f"{_ms(ordered[0])}..{_ms(ordered[len(ordered) // 2])}..{_ms(ordered[-1])}"
        self._emit(f"rebalance after step {step}: {_batches(old)} -> {_batches(new)} "
                   f"from step {effective} (compute ms {times})")

    def speeds(self, step: int, speeds: Sequence[float]) -> None:
        self._emit(f"speeds change at step {step}: " + ",".join(f"{s:g}" for s in speeds))

    def table(self, stats: Sequence[WorkerStats], declared: Sequence[float] | None, first_step: int) -> None:
        self._emit(f"per worker, steps {first_step}+ (last half of the run):")
        self._emit(f"{'rank':>4} {'declared':>8} {'batch':>7} {'compute ms':>10} {'wait ms':>8} {'samples/s':>10}")
        for s in stats:
            speed = f"{declared[s.rank]:g}" if declared else "varied"
            self._emit(f"{s.rank:>4} {speed:>8} {s.mean_batch:>7.1f} {_ms(s.mean_compute_s):>10} "
                       f"{_ms(s.mean_wait_s):>8} {s.speed:>10.0f}")

    def push_progress(self, version: int, total: int, epochs: float, loss: float, batches: Sequence[str],
                      cycle_s: Sequence[float | None], staleness: Sequence[float | None]) -> None:
        """ASP: one line per control interval of pushes (per worker: last batch, mean cycle, mean staleness)."""
        cycles = "/".join("-" if c is None else f"{c * 1e3:.0f}" for c in cycle_s)
        stale = "/".join("-" if s is None else f"{s:.1f}" for s in staleness)
        self._emit(f"update {version:>6}/{total} | epoch {epochs:5.2f} | loss {loss:.4f} | batches {'/'.join(batches)}"
                   f" | cycle ms {cycles} | staleness {stale}", transient=True)

    def push_table(self, workers: Sequence[dict[str, Any]]) -> None:
        """ASP: the final per-worker table."""
        self._emit(f"{'worker':>6} {'updates':>8} {'batch':>7} {'cycle ms':>9} {'staleness mean/p50/p99/max':>27} "
                   f"{'updates/s':>10}")
        for w in workers:
            quantiles = f"{w.get('p50_staleness', '-')}/{w.get('p99_staleness', '-')}/{w['max_staleness']}"
            self._emit(f"{w['rank']:>6} {w['updates']:>8} {w['mean_batch']:>7.1f} {w['mean_cycle_s'] * 1e3:>9.1f} "
                       f"{w['mean_staleness']:>10.2f}/{quantiles:<16} {w['updates_per_s']:>10.2f}")
