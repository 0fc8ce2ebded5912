"""BSP's record of a run (rank 0): step rows streamed to ``metrics.jsonl``, bounded aggregates for the summary.

:class:`Telemetry` gets every worker's rows once per control interval
(``interval``), writes them as ``step`` events through the one
:class:`~omnilearn.observe.events.EventRecorder`, and keeps no row: per step
it adds one record (ideal and measured step time, each worker's batch,
compute and wait) to a :class:`~omnilearn.observe.suffix.SuffixStats`, so the
summary's "last half" statistics are exact while memory stays
``O(steps / chunk)`` small vectors. The formulas are those of
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

from omnilearn.balance.efficiency import StepRow, WorkerStats, by_step, ideal_step_s, measured_step_s
from omnilearn.config import BalanceConfig
from omnilearn.observe.events import EventRecorder
from omnilearn.observe.suffix import SuffixStats
from omnilearn.runplan import RunPlan

FAILED_AT_ENV = "OMNILEARN_FAILED_AT"  # set by the launcher's restart loop: when the failed attempt ended
# The columns of one step row, in order: the one definition (bsp/steps.py writes rows, tf/session.py too).
ROW_FIELDS = ("step", "batch", "compute_s", "wait_s", "step_s", "loss", "delay_s", "lr")


class Telemetry:
    def __init__(self, cfg: BalanceConfig, run: RunPlan, run_dir: Path | None) -> None:
        self.cfg, self.run, self.run_dir = cfg, run, run_dir
        self.events = EventRecorder(run_dir, quiet=cfg.quiet)
        self.console = self.events.console
        n = cfg.workers
        # Per step: step, ideal_s, measured_s, then per worker batch, compute_s, wait_s (in rank order).
        self.stats = SuffixStats(("max", "sum", "sum") + ("sum",) * (3 * n))
        self.steps_recorded = 0
        self.steps_before = 0  # steps of earlier attempts (resumed from a checkpoint); not in the statistics
        self.resumed_at: int | None = None
        self.checkpoint_costs: list[float] = []  # seconds per save in this attempt (a few per run)
        self.checkpoint_bytes: int | None = None
        self.final_train_loss: float | None = None

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
        """One control interval: ``table[rank]`` holds that rank's rows ``[step, batch, compute_s, ...]``."""
        steps, loss = self._record_rows(table)
        eff = getattr(decision, "effective_step", None)
        eff = effective if eff is None else eff
        total = self.run.total_steps
        applied = decision.changed and (total is None or eff < total)
        self.events.decision(decision, eff, applied)
        if steps:
            self._progress(decision, steps, loss)
        if applied:
            self.console.rebalance(decision.step, eff, decision.old, decision.new, decision.times_s)
        self.events.flush()

    def _record_rows(self, table: list[list[list[float]]]) -> tuple[dict[int, list[StepRow]], float]:
        """Write the step events, add one summary record per step; the interval's rows by step, its mean loss."""
        spe, new_rows, loss = self.run.steps_per_epoch, [], {}
        for rank, rows in enumerate(table):
            for step, batch, compute_s, wait_s, step_s, row_loss, delay_s, lr in rows:
                step, batch = int(step), int(batch)
                self.events.write("step", step=step, epoch=step // spe, rank=rank, batch=batch, compute_s=compute_s,
                                  wait_s=wait_s, step_s=step_s, loss=row_loss, lr=lr, delay_s=delay_s)
                new_rows.append(StepRow(step, rank, batch, compute_s, wait_s, step_s))
                loss[step] = loss.get(step, 0.0) + row_loss * batch / self.cfg.global_batch
        steps = by_step(new_rows)
        for step in sorted(steps):
            rows = sorted(steps[step], key=lambda r: r.rank)
            self.stats.add([step, ideal_step_s(rows), measured_step_s(rows), *(r.batch for r in rows),
                            *(r.compute_s for r in rows), *(r.wait_s for r in rows)])
            self.final_train_loss = loss[step]
            self.steps_recorded += 1
        return steps, fmean(loss.values()) if loss else float("nan")

    def _progress(self, decision, steps: dict[int, list[StepRow]], loss: float) -> None:
        last = max(steps)
        self.console.progress(
            last + 1, self.run.total_steps or "?", last // self.run.steps_per_epoch, loss, decision.old,
            fmean(measured_step_s(v) for v in steps.values()),
            fmean(ideal_step_s(v) for v in steps.values()),
            max(fmean(r.wait_s for r in v) for v in zip(*steps.values())),
        )

    def evaluation(self, epoch: int | None, step: int, wall_s: float, loss: float, accuracy: float) -> None:
        self.events.evaluation(epoch=epoch, step=step, wall_s=wall_s, test_loss=loss, test_accuracy=accuracy)

    def worker_stats(self, first_index: int) -> list[WorkerStats]:
        """Per-worker means over the recorded steps from the ``first_index``-th on (what ``worker_stats`` gives)."""
        n, sums = self.cfg.workers, self.stats.since(first_index)
        count = self.stats.count - max(0, first_index)
        out = []
        for rank in range(n):
            batch, compute, wait = (sums[3 + k * n + rank] / count for k in range(3))
            out.append(WorkerStats(rank, batch, compute, wait, batch / compute))
        return out

    def finish(self, wall_s: float, train_s: float, save: Callable[[Path], None] | None = None) -> dict:
        """``train_s``: the wall time of the training loop without evaluation; ``save(run_dir)`` writes the model
        (:func:`omnilearn.observe.modelfile.saver`, or the TensorFlow runtime's ``model.weights.h5``)."""
        summary = self.summary(wall_s, train_s)
        self.events.finish(summary, save)
        first = summary["stats_from_step"]
        self.console.table(self.worker_stats(self.steps_recorded // 2), summary["declared_speeds"], first)
        self.stats.close()
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
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
