"""BSP's record of a run (rank 0): per-step totals, bounded aggregates for the summary.

Rank 0's files and console do not grow with the number of workers. Each rank
writes its own step rows to ``RUN_DIR/steps/rank-<r>.jsonl`` and keeps its own
sums (:class:`~omnilearn.observe.rankrows.RankRows`); once per window rank 0
sums the window's per-step totals from the rows its meeting carried
(:meth:`~omnilearn.observe.rankrows.Totals.of_table`, one vectorised pass) and :class:`Telemetry` adds one
record per step (step, ideal and measured step time) to a
:class:`~omnilearn.observe.suffix.SuffixStats`, so the summary's "last half"
statistics are exact while memory stays ``O(steps / chunk)`` small vectors.
The per-worker means come from one gather of every rank's sums at the end.
A process that holds every rank's rows at once (TensorFlow's worker 0, the
tests) passes them to :meth:`Telemetry.interval`, which writes every rank's
file and computes the same totals. The formulas are those of
:mod:`omnilearn.balance.efficiency` (``T* = B / sum v_i + min wait``, balance
efficiency ``mean T* / mean T`` over the last half).

Run its tests: ``python -m pytest -q tests/unit/test_recorder.py``
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from statistics import fmean
from typing import Callable

from omnilearn.balance.efficiency import WorkerStats
from omnilearn.config import BalanceConfig
from omnilearn.observe import heldrun
from omnilearn.observe.events import EventRecorder
from omnilearn.observe.rankrows import ROW_NAMES, RankRows, Totals, void_gone
from omnilearn.observe.suffix import SuffixStats
from omnilearn.runplan import RunPlan

FAILED_AT_ENV = "OMNILEARN_FAILED_AT"  # set by the launcher's restart loop: when the failed attempt ended
# The columns of one step row, in order: the one definition (bsp/steps.py writes rows, tf/session.py too).
ROW_FIELDS = ROW_NAMES


class Telemetry:
    """Rank 0's record. ``own_rows``: every rank writes its own rows (BSP's session); otherwise the rows of every
    rank reach :meth:`interval` at once and this object writes their files (TensorFlow's worker 0, the tests)."""

    def __init__(self, cfg: BalanceConfig, run: RunPlan, run_dir: Path | None, own_rows: bool = False) -> None:
        self.cfg, self.run, self.run_dir, self.own_rows = cfg, run, run_dir, own_rows
        self.events = EventRecorder(run_dir, quiet=cfg.quiet)
        self.console = self.events.console
        self.stats = SuffixStats(("max", "sum", "sum"))  # per step: step, ideal_s, measured_s
        self.ranks: list[RankRows] = []  # own_rows=False: every rank's rows, kept here
        self.gathered: list[list[float]] | None = None  # own_rows=True: every rank's summary_row, at the end
        self.steps_recorded = 0
        self.steps_before = 0  # steps of earlier attempts (resumed from a checkpoint); not in the statistics
        self.resumed_at: int | None = None
        self.checkpoint_costs: list[float] = []  # seconds per save in this attempt (a few per run)
        self.checkpoint_bytes: int | None = None
        self.final_train_loss: float | None = None
        self.record_s = 0.0  # rank 0's time in window(), plus (own_rows) its own rows' writing: finish()

    def state_dict(self) -> dict:
        """What a resumed run's record carries over: counts and the last values, not the step statistics."""
        events = self.events
        return {"steps": self.steps_before + self.steps_recorded, "rebalances": events.rebalances,
                "speed_changes": [[at, list(v)] for at, v in events.speed_changes],
                "last_eval": dict(events.last_eval),
                "final_train_loss": self.final_train_loss}

    def resume(self, state: dict, step: int, from_workers: int) -> None:
        """Carry ``state`` over and write a ``resume`` event: records of steps >= ``step`` before it are void.

        The summary's statistics (balance efficiency, per-worker means) cover
        the steps trained since this resume; its ``steps`` counts the whole run.
        """
        self.steps_before, self.resumed_at = int(state.get("steps", step)), step
        self.events.rebalances = int(state.get("rebalances", 0))
        self.events.speed_changes = [(int(at), tuple(v)) for at, v in state.get("speed_changes", [])]
        self.events.last_eval = dict(state.get("last_eval", {}))
        self.final_train_loss = state.get("final_train_loss")
        heldrun.reclaim(self.run_dir, "metrics.jsonl")  # a re-run's replaced record, taken back
        void_gone(self.run_dir, self.cfg.workers if self.own_rows else 0, step)
        now = time.time()
        failed_at = os.environ.get(FAILED_AT_ENV)
        self.events.write("resume", step=step, workers=self.cfg.workers, from_workers=from_workers, at=now,
                          since_failure_s=now - float(failed_at) if failed_at else None)
        self.events.flush()
        self.console.info(f"resumed at step {step} with {self.cfg.workers} workers"
                          + (f" (checkpoint of {from_workers})" if from_workers != self.cfg.workers else ""))

    def loaded(self, load_s: float) -> None:
        """How long loading the checkpoint took (after the ``resume`` event)."""
        self.events.write("checkpoint_loaded", load_s=load_s)

    def checkpoint(self, step: int, size: int, save_s: float) -> None:
        """A checkpoint written at ``step``: its bytes and the seconds the save cost (every rank waited)."""
        self.events.write("checkpoint", step=step, bytes=size, save_s=save_s)
        self.checkpoint_costs.append(save_s)
        self.checkpoint_bytes = size

    @property
    def last_eval(self) -> dict:
        return self.events.last_eval

    def speeds(self, step: int, speeds: tuple[float, ...]) -> None:
        if self.events.speeds(step, speeds, step=step) and step > 0:
            self.console.speeds(step, speeds)

    def interval(self, table: list[list[list[float]]], decision, effective: int) -> None:
        """One window from every rank's rows at once: ``table[rank]`` holds that rank's ``[step, batch, ...]``."""
        if not self.ranks:
            self.ranks = [RankRows(rank, self.run.steps_per_epoch, self.run_dir) for rank in range(len(table))]
        start = time.perf_counter()
        for ranks, rows in zip(self.ranks, table):
            ranks.add(rows)
        self.record_s += time.perf_counter() - start
        self.window(Totals.of_table(table, self.cfg.global_batch), decision, effective)

    def window(self, totals: Totals | None, decision, effective: int) -> None:
        """One control window: its per-step totals (None: no step), the decision at its end."""
        start = time.perf_counter()
        if totals is not None and totals.steps:
            self._record(totals)
        eff = getattr(decision, "effective_step", None)
        eff = effective if eff is None else eff
        total = self.run.total_steps
        applied = decision.changed and (total is None or eff < total)
        self.events.decision(decision, eff, applied)
        if totals is not None and totals.steps:
            self.console.progress(
                totals.steps[-1] + 1, self.run.total_steps or "?", totals.steps[-1] // self.run.steps_per_epoch,
                fmean(totals.loss), decision.old, fmean(totals.measured_s), fmean(totals.ideal_s), totals.max_wait_s)
        if applied:
            self.console.rebalance(decision.step, eff, decision.old, decision.new, decision.times_s)
        self.events.flush()
        self.record_s += time.perf_counter() - start

    def _record(self, totals: Totals) -> None:
        """One summary record per step: O(1) per step whatever the number of workers."""
        self.stats.extend(list(zip(totals.steps, totals.ideal_s, totals.measured_s)))  # one conversion a window
        self.final_train_loss = totals.loss[-1]
        self.steps_recorded += len(totals.steps)

    def worker_sums(self, rows: list[list[float]], own_add_s: float = 0.0) -> None:
        """``own_rows``: every rank's :meth:`~omnilearn.observe.rankrows.RankRows.summary_row`, in rank order, and
        the time rank 0 spent writing its own rows (part of its record's cost)."""
        self.gathered = [list(r) for r in rows]
        self.record_s += own_add_s

    def evaluation(self, epoch: int | None, step: int, wall_s: float, loss: float, accuracy: float) -> None:
        self.events.evaluation(epoch=epoch, step=step, wall_s=wall_s, test_loss=loss, test_accuracy=accuracy)

    def worker_stats(self, first_index: int) -> list[WorkerStats]:
        """Per-worker means over the recorded steps from the ``first_index``-th on: ``steps // 2`` (the last half)
        or ``steps - control_interval`` (the last interval), the two a summary row holds."""
        if self.ranks:
            sums = [r.sums(first_index) for r in self.ranks]
        elif self.gathered is None:
            raise RuntimeError("the per-worker sums are not here: worker_sums() was not called")
        elif first_index == self.steps_recorded // 2:
            sums = [r[:3] for r in self.gathered]
        elif first_index == self.steps_recorded - self.cfg.control_interval:
            sums = [r[3:] for r in self.gathered]
        else:
            raise ValueError(f"first_index {first_index}: the gathered sums start at the last half or interval")
        count = self.steps_recorded - max(0, first_index)
        return [WorkerStats(rank, batch / count, compute / count, wait / count, batch / compute)
                for rank, (batch, compute, wait) in enumerate(sums)]

    def finish(self, wall_s: float, train_s: float, save: Callable[[Path], None] | None = None) -> dict:
        """``train_s``: the wall time of the training loop without evaluation; ``save(run_dir)`` writes the model
        (:func:`omnilearn.observe.modelfile.saver`, or the TensorFlow runtime's ``model.weights.h5``)."""
        summary = self.summary(wall_s, train_s)
        self.events.finish(summary, save)
        first = summary["stats_from_step"]
        self.console.table(self.worker_stats(self.steps_recorded // 2), summary["declared_speeds"], first)
        self.stats.close()
        for ranks in self.ranks:
            ranks.close()
        label = f"[{self.cfg.speed_schedule or self.cfg.speeds} {self.cfg.controller}] " if self.cfg.quiet else ""
        accuracy = summary["test_accuracy"]
        self.console.info(
            f"{label}balance efficiency {summary['balance_efficiency']:.3f} "
            f"(ideal step {summary['ideal_step_s'] * 1e3:.1f} ms, measured {summary['mean_step_s'] * 1e3:.1f} ms) | "
            f"{summary['samples_per_s']:.0f} samples/s | "
            + (f"test accuracy {accuracy:.2%} | " if accuracy is not None else "")
            + f"{summary['steps']} steps in {wall_s:.1f} s"
            + (f" (resumed at step {self.resumed_at})" if self.resumed_at is not None else "")
        )
        self.events.report_run_dir(self.cfg.quiet)
        return summary

    def summary(self, wall_s: float, train_s: float) -> dict:
        """The summary of the steps recorded; the last half starts at the ``steps // 2``-th recorded step."""
        steps = self.steps_recorded
        total = self.steps_before + steps
        half = steps // 2
        first = int(self.stats.record(half)[0])
        stats = self.worker_stats(half)
        last = [s.mean_compute_s for s in self.worker_stats(steps - self.cfg.control_interval)]
        _, ideal_sum, measured_sum, *_ = self.stats.since(half)
        declared = self.events.declared_speeds(first)
        return {
            "steps": total, "wall_s": wall_s, "train_s": train_s, "wall_step_s": train_s / total,
            "samples_per_s": total * self.cfg.global_batch / train_s,
            "resumed_at_step": self.resumed_at,
            "checkpoints": {"saved": len(self.checkpoint_costs), "bytes": self.checkpoint_bytes,
                            "mean_save_s": fmean(self.checkpoint_costs) if self.checkpoint_costs else None}, "steps_since_resume": steps if self.resumed_at is not None else None,
            "final_train_loss": self.final_train_loss, "test_accuracy": self.last_eval.get("test_accuracy"),
            "test_loss": self.last_eval.get("test_loss"), "controller": self.cfg.controller,
            "rebalances": self.events.rebalances, "stats_from_step": first,
            "balance_efficiency": ideal_sum / measured_sum,
            "ideal_step_s": ideal_sum / (steps - half),
            "mean_step_s": measured_sum / (steps - half),
            "declared_speeds": declared,  # in force over the last half; None when a schedule changed them there
            "speed_changes": [{"step": s, "speeds": list(v)} for s, v in self.events.speed_changes],
            "last_interval_compute_s": last,
            "last_interval_compute_spread": max(last) / min(last) - 1,
            "workers": [
                {"rank": s.rank, "declared_speed": declared[s.rank] if declared else None, "mean_batch": s.mean_batch,
                 "mean_compute_s": s.mean_compute_s, "mean_wait_s": s.mean_wait_s, "speed": s.speed}
                for s in stats
            ],
            # rank 0's bookkeeping per step (recording, progress line, decision event; not the collectives)
            "rank0_record_ms_per_step": 1e3 * self.record_s / steps,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
