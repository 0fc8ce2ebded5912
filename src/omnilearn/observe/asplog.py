"""The parameter server's record of an ASP run: push events streamed, bounded aggregates for the summary.

Events (through the one :class:`~omnilearn.observe.events.EventRecorder`):
``push`` (one per applied gradient: worker ``rank`` 0..n-1, its ``batch``,
``staleness``, ``pulled_version``, ``cycle_s`` and ``compute_s``, ``loss``,
the ``lr`` applied, the server ``version`` after it, training ``wall_s``,
``epoch`` of data dealt, ``data_epoch``: the epoch its samples came from),
``decision``, ``speeds``, ``eval`` (test loss and accuracy with training
wall time), ``drop`` (a worker dropped: ``rank`` 0..n-1 as in ``push``,
``version``, ``reason``, ``redealt`` samples dealt again and their
``data_epoch`` (None: it held none), the ``live`` workers left and their
new ``batches``; also one warning line on stderr naming the worker's
process rank) and ``resume`` (``version``, ``step``: the run continues
from the checkpoint of that version; records after it before this line are
void, :func:`~omnilearn.observe.metrics.replay`). :meth:`ASPLog.state_dict`
is what a checkpoint carries over (counts and last values); after a resume
the summary's per-worker means cover the pushes since the resume, its
counts the whole run (as BSP's ``Telemetry``). No push is kept in memory: per worker
a :class:`~omnilearn.observe.suffix.SuffixStats` gives the exact "last half
of its pushes" means, one more gives the last half's maximum staleness, and
the progress line sums the current control interval only.

Run its tests: ``python -m pytest -q tests/unit/test_recorder.py tests/dist/test_asp_server.py
tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path
from statistics import fmean
from typing import Callable

from omnilearn.asp.rules import Staleness
from omnilearn.asp.settings import ASPSettings
from omnilearn.config import BalanceConfig
from omnilearn.observe.events import EventRecorder
from omnilearn.observe.suffix import SuffixStats

PER_WORKER = ("batch", "cycle_s", "compute_s", "staleness")  # summed, summed, summed, maximum


class ASPLog:
    def __init__(self, cfg: BalanceConfig, settings: ASPSettings, total_pushes: int, run_dir: Path | None) -> None:
        self.cfg, self.settings, self.total, self.n = cfg, settings, total_pushes, cfg.workers
        self.events = EventRecorder(run_dir, quiet=cfg.quiet)
        self.console = self.events.console
        self.per_worker = [SuffixStats(("sum", "sum", "sum", "max")) for _ in range(self.n)]
        self.all_staleness = SuffixStats(("max",))
        self.last_losses: deque[float] = deque(maxlen=self.n)
        self.samples = 0
        self.dropped: list[dict] = []  # {"rank", "version", "reason"} per dropped worker, in order
        self.resumed_at: int | None = None  # the version this process resumed from
        self._new_interval()

    def _new_interval(self) -> None:
        """Progress-line sums over the pushes since the last line (per worker: count, cycle, staleness, batch)."""
        self.recent = [[0, 0.0, 0.0, None] for _ in range(self.n)]
        self.recent_loss, self.recent_count = 0.0, 0

    @property
    def last_eval(self) -> dict:
        return self.events.last_eval

    def speeds(self, version: int, speeds: tuple[float, ...]) -> None:
        if self.events.speeds(version, speeds, version=version, step=version // self.n) and version > 0:
            self.console.speeds(version, speeds)

    def push(self, version: int, worker: int, req, staleness: int, lr: float, wall_s: float, epochs: float,
             data_epoch: int | None = None) -> None:
        """One applied push (``req``: the worker's request: batch, pulled_version, cycle_s, compute_s, loss)."""
        where = {} if data_epoch is None else {"data_epoch": data_epoch}
        self.events.write("push", version=version, rank=worker, batch=req.batch, staleness=staleness,
                          pulled_version=req.pulled_version, cycle_s=req.cycle_s, compute_s=req.compute_s,
                          loss=req.loss, lr=lr, wall_s=wall_s, epoch=epochs, **where)
        self.per_worker[worker].add([req.batch, req.cycle_s, req.compute_s, staleness])
        self.all_staleness.add([staleness])
        self.last_losses.append(req.loss)
        self.samples += req.batch
        mine = self.recent[worker]
        mine[0], mine[1], mine[2], mine[3] = mine[0] + 1, mine[1] + req.cycle_s, mine[2] + staleness, req.batch
        self.recent_loss, self.recent_count = self.recent_loss + req.loss, self.recent_count + 1
        if self.recent_count >= self.cfg.control_interval * self.n or version == self.total:
            self._progress(version, epochs)

    def _progress(self, version: int, epochs: float) -> None:
        per = self.recent
        self.console.push_progress(
            version, self.total, epochs, self.recent_loss / self.recent_count,
            [str(int(b)) if b is not None else "-" for _, _, _, b in per],
            [c / k if k else None for k, c, _, _ in per], [s / k if k else None for k, _, s, _ in per])
        self._new_interval()
        self.events.flush()

    def refused(self, version: int, worker: int, staleness: int) -> None:
        """A push refused for its staleness (``--max-staleness``): the worker recomputes it on fresh weights."""
        self.events.write("refused", version=version, rank=worker, staleness=staleness)

    def decision(self, d, effective_step: int | None = None) -> None:
        """A controller decision; a changed one is applied at once (from ``effective_step``, default ``d.step``)."""
        eff = getattr(d, "effective_step", None)
        eff = (d.step if effective_step is None else effective_step) if eff is None else eff
        self.events.decision(d, eff, d.changed)
        if d.changed:
            self.console.rebalance(d.step, eff, d.old, d.new, d.times_s)

    def drop(self, version: int, worker: int, reason: str, redealt: int, live: list[int],
             batches: tuple[int, ...], data_epoch: int | None = None) -> None:
        """Worker ``worker`` (0..n-1) was dropped: a ``drop`` event and one warning line on stderr.

        ``redealt``: samples it held that are dealt again (of epoch ``data_epoch``); ``batches``: every worker's.
        """
        self.dropped.append({"rank": worker, "version": version, "reason": reason})
        self.events.write("drop", version=version, rank=worker, reason=reason, redealt=redealt,
                          data_epoch=data_epoch, live=live, batches=[batches[w] for w in live])
        self.events.flush()
        rest = (f"{len(live)} worker(s) go on with batches {'/'.join(str(batches[w]) for w in live)}" if live
                else "no worker is left")
        print(f"omnilearn: warning: dropped worker rank {worker + 1} at version {version}: {reason}; "
              f"{redealt} samples it held are dealt again; {rest}", file=sys.stderr, flush=True)

    def flush(self) -> None:
        """Write the held events (before a checkpoint: every event up to its version is then on disk)."""
        self.events.flush()

    def state_dict(self) -> dict:
        """What a resumed run's record carries over: counts and last values, not the per-push statistics."""
        events = self.events
        return {"samples": self.samples, "last_losses": list(self.last_losses), "rebalances": events.rebalances,
                "speed_changes": [[at, list(v)] for at, v in events.speed_changes],
                "last_eval": dict(events.last_eval), "dropped": [dict(d) for d in self.dropped]}

    def resume(self, state: dict, version: int, step: int) -> None:
        """Carry ``state`` over and write a ``resume`` event: records after ``version`` before it are void."""
        events = self.events
        self.samples = int(state.get("samples", 0))
        self.last_losses.extend(float(v) for v in state.get("last_losses", []))
        events.rebalances = int(state.get("rebalances", 0))
        events.speed_changes = [(int(at), tuple(v)) for at, v in state.get("speed_changes", [])]
        events.last_eval = dict(state.get("last_eval", {}))
        self.dropped = [dict(d) for d in state.get("dropped", [])]
        self.resumed_at = version
        events.write("resume", version=version, step=step, workers=self.n, at=time.time())
        events.flush()
        self.console.info(f"resumed at version {version} (step {step}) with {self.n} workers"
                          if version else "no checkpoint yet: the run starts over")

    def evaluation(self, epoch: int, version: int, wall_s: float, loss: float, accuracy: float) -> None:
        self.events.evaluation(epoch=epoch, version=version, step=version // self.n, wall_s=wall_s, test_loss=loss,
                               test_accuracy=accuracy)

    def finish(self, wall_s: float, train_s: float, staleness: Staleness, save: Callable[[Path], None] | None,
               samples_dealt: int, coverage: dict | None = None, steps: int | None = None,
               extra: dict | None = None) -> dict:
        """Write the summary, then the model by ``save(run_dir)`` (the runtime's own format). ``coverage``: the
        server's per-epoch sample counts (:class:`~omnilearn.asp.rules.Coverage`); ``steps``: steps of ``B``
        samples done (default: updates // n, which is it while no worker was dropped); ``extra``: the runtime's
        own fields."""
        summary = {**self.summary(wall_s, train_s, staleness), "samples_dealt": samples_dealt, **(coverage or {}),
                   "dropped": [dict(d) for d in self.dropped], "resumed_at_version": self.resumed_at,
                   **(extra or {})}
        if steps is not None:
            summary["steps"] = steps
        self.events.finish(summary, save)
        for stats in (*self.per_worker, self.all_staleness):
            stats.close()
        self.console.push_table(summary["workers"])
        label = f"[asp {self.cfg.speeds} {self.cfg.controller}] " if self.cfg.quiet else ""
        accuracy = summary["test_accuracy"]
        self.console.info(f"{label}{summary['updates']} updates in {train_s:.1f} s | "
                          + (f"test accuracy {accuracy:.2%} | " if accuracy is not None else "")
                          + f"staleness mean {summary['mean_staleness']:.2f}, p50 {summary['p50_staleness']}, "
                          f"p99 {summary['p99_staleness']}, max {summary['max_staleness']}"
                          + (f" (bound {self.settings.max_staleness}: {summary['refused']} pushes recomputed)"
                             if self.settings.max_staleness is not None else ""))
        self.events.report_run_dir(self.cfg.quiet)
        return summary

    def worker_summary(self, w: int, staleness: Staleness, train_s: float) -> dict:
        """Worker ``w``'s counts, and its means over the last half of its pushes."""
        stats = self.per_worker[w]
        half = stats.count // 2
        batch, cycle_s, compute_s, max_stale = stats.since(half)
        k = stats.count - half
        return {
            "rank": w, "updates": staleness.counts[w], "mean_staleness": staleness.mean(w),
            "max_staleness": staleness.maxima[w], "updates_per_s": staleness.counts[w] / train_s,
            "p50_staleness": staleness.quantile(0.5, w), "p99_staleness": staleness.quantile(0.99, w),
            "refused": staleness.refused[w],
            "max_staleness_last_half": int(max_stale) if k else 0,
            "mean_batch": batch / k if k else 0.0, "mean_cycle_s": cycle_s / k if k else 0.0,
            "mean_compute_s": compute_s / k if k else 0.0,
        }

    def summary(self, wall_s: float, train_s: float, staleness: Staleness) -> dict:
        n, s = self.n, self.settings
        updates = sum(staleness.counts)
        pushes = self.all_staleness.count
        changes = self.events.speed_changes
        return {
            "mode": "asp", "updates": updates, "steps": updates // n, "wall_s": wall_s, "train_s": train_s,
            "samples_per_s": self.samples / train_s, "controller": self.cfg.controller,
            "lr_scaling": s.lr_scaling, "staleness_lr": s.staleness_lr, "rebalances": self.events.rebalances,
            "test_accuracy": self.last_eval.get("test_accuracy"), "test_loss": self.last_eval.get("test_loss"),
            "final_train_loss": fmean(self.last_losses) if self.last_losses else None,
            "mean_staleness": sum(staleness.totals) / max(1, updates), "max_staleness": max(staleness.maxima),
            "p50_staleness": staleness.quantile(0.5), "p99_staleness": staleness.quantile(0.99),
            "max_staleness_bound": s.max_staleness, "refused": sum(staleness.refused),
            # after the controller's first decisions: the transient of the first intervals left out
            "max_staleness_last_half": int(self.all_staleness.since(pushes // 2)[0]) if pushes else 0,
            "declared_speeds": list(changes[-1][1]) if len(changes) == 1 else None,
            "speed_changes": [{"version": v, "speeds": list(sp)} for v, sp in changes],
            "workers": [self.worker_summary(w, staleness, train_s) for w in range(n)],
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
