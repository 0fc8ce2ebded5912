"""Rank 0's record of a run: metrics.jsonl, progress output, summary.json, model.pt."""

from __future__ import annotations

import time
from pathlib import Path
from statistics import fmean

import torch

from omnilearn.config import BalanceConfig
from omnilearn.balance.controllers import Decision
from omnilearn.balance.efficiency import StepRow, balance_efficiency, by_step, ideal_step_s, measured_step_s, worker_stats
from omnilearn.observe.console import Console
from omnilearn.observe.rundir import MetricsLog, save_model, write_json
from omnilearn.runplan import RunPlan


class Telemetry:
    def __init__(self, cfg: BalanceConfig, run: RunPlan, run_dir: Path | None) -> None:
        self.cfg, self.run, self.run_dir = cfg, run, run_dir
        self.log = MetricsLog(run_dir) if run_dir is not None else None
        self.console = Console(quiet=cfg.quiet)
        self.rows: list[StepRow] = []
        self.train_loss: dict[int, float] = {}
        self.last_eval: dict = {}
        self.speed_changes: list[tuple[int, tuple[float, ...]]] = []
        self.decisions = 0

    def _write(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(record)

    def speeds(self, step: int, speeds: tuple[float, ...]) -> None:
        if self.speed_changes and speeds == self.speed_changes[-1][1]:
            return
        self.speed_changes.append((step, speeds))
        self._write({"event": "speeds", "step": step, "speeds": list(speeds)})
        if step > 0:
            self.console.speeds(step, speeds)

    def interval(self, table: list[list[list[float]]], decision: Decision, effective: int) -> None:
        spe = self.run.steps_per_epoch
        new_rows = []
        for rank, rows in enumerate(table):
            for step, batch, compute_s, wait_s, step_s, loss, delay_s, lr in rows:
                step, batch = int(step), int(batch)
                self._write({"event": "step", "step": step, "epoch": step // spe, "rank": rank, "batch": batch,
                             "compute_s": compute_s, "wait_s": wait_s, "step_s": step_s, "loss": loss,
                             "lr": lr, "delay_s": delay_s})
                new_rows.append(StepRow(step, rank, batch, compute_s, wait_s, step_s))
                self.train_loss[step] = self.train_loss.get(step, 0.0) + loss * batch / self.cfg.global_batch
        self.rows.extend(new_rows)
        steps = by_step(new_rows)
        total = self.run.total_steps
        applied = decision.changed and (total is None or effective < total)
        new = decision.new if applied else decision.old
        self._write({"event": "decision", "step": decision.step, "effective_step": effective if applied else None,
                     "old": list(decision.old), "new": list(new), "proposed": list(decision.new),
                     "times_s": list(decision.times_s), "changed": applied, "reason": decision.reason})
        self._progress(decision, steps)
        if applied:
            self.decisions += 1
            self.console.rebalance(decision.step, effective, decision.old, decision.new, decision.times_s)
        if self.log is not None:
            self.log.flush()

    def _progress(self, decision: Decision, steps: dict[int, list[StepRow]]) -> None:
        last = max(steps)
        self.console.progress(
            last + 1, self.run.total_steps or "?", last // self.run.steps_per_epoch,
            fmean(self.train_loss[s] for s in steps), decision.old,
            fmean(measured_step_s(v) for v in steps.values()),
            fmean(ideal_step_s(v) for v in steps.values()),
            max(fmean(r.wait_s for r in v) for v in zip(*steps.values())),
        )

    def evaluation(self, epoch: int | None, step: int, wall_s: float, loss: float, accuracy: float) -> None:
        self.last_eval = {"epoch": epoch, "step": step, "wall_s": wall_s, "test_loss": loss, "test_accuracy": accuracy}
        self._write({"event": "eval", **self.last_eval})

    def finish(self, wall_s: float, train_s: float, model: torch.nn.Module | None) -> dict:
        """``train_s``: the wall time of the training loop without evaluation."""
        summary = self.summary(wall_s, train_s)
        if self.run_dir is not None:
            write_json(self.run_dir / "summary.json", summary)
            if model is not None:
                save_model(self.run_dir, model)
        if self.log is not None:
            self.log.close()
        first = summary["stats_from_step"]
        self.console.table(worker_stats(self.rows, first), summary["declared_speeds"], first)
        label = f"[{self.cfg.speed_schedule or self.cfg.speeds} {self.cfg.controller}] " if self.cfg.quiet else ""
        accuracy = summary["test_accuracy"]
        self.console.info(
            f"{label}balance efficiency {summary['balance_efficiency']:.3f} (ideal step {summary['ideal_step_s'] * 1e3:.1f} ms, "
            f"measured {summary['mean_step_s'] * 1e3:.1f} ms) | {summary['samples_per_s']:.0f} samples/s | "
            + (f"test accuracy {accuracy:.2%} | " if accuracy is not None else "")
            + f"{summary['steps']} steps in {wall_s:.1f} s"
        )
        if self.run_dir is not None and not self.cfg.quiet:
            self.console.info(f"run directory: {self.run_dir}")
        return summary

    def summary(self, wall_s: float, train_s: float) -> dict:
        done = sorted(by_step(self.rows))  # the steps run (an API loop may skip the rest of an epoch)
        steps = len(done)
        first = done[steps // 2]
        stats = worker_stats(self.rows, first)
        last = {s.rank: s.mean_compute_s
                for s in worker_stats(self.rows, done[max(0, steps - self.cfg.control_interval)])}
        half = [v for s, v in by_step(self.rows).items() if s >= first]
        declared = self.speed_changes[-1][1] if self.speed_changes[-1][0] <= first else None
        return {
            "steps": steps, "wall_s": wall_s, "train_s": train_s, "wall_step_s": train_s / steps,
            "samples_per_s": steps * self.cfg.global_batch / train_s,
            "final_train_loss": self.train_loss[done[-1]], "test_accuracy": self.last_eval.get("test_accuracy"),
            "test_loss": self.last_eval.get("test_loss"), "controller": self.cfg.controller,
            "rebalances": self.decisions, "stats_from_step": first,
            "balance_efficiency": balance_efficiency(self.rows, first),
            "ideal_step_s": fmean(ideal_step_s(v) for v in half),
            "mean_step_s": fmean(measured_step_s(v) for v in half),
            "declared_speeds": list(declared) if declared else None,  # in force over the last half; None when a schedule changed them there
            "speed_changes": [{"step": s, "speeds": list(v)} for s, v in self.speed_changes],
            "last_interval_compute_s": [last[r] for r in sorted(last)],
            "last_interval_compute_spread": max(last.values()) / min(last.values()) - 1,
            "workers": [
                {"rank": s.rank, "declared_speed": declared[s.rank] if declared else None, "mean_batch": s.mean_batch,
                 "mean_compute_s": s.mean_compute_s, "mean_wait_s": s.mean_wait_s, "speed": s.speed}
                for s in stats
            ],
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

