"""The parameter server's record of an ASP run: metrics.jsonl, progress, summary.json, model.pt.

Events: ``push`` (one per applied gradient: worker ``rank`` 0..n-1, its
``batch``, ``staleness``, ``cycle_s`` and ``compute_s``, the ``lr`` applied,
the server ``version`` after it, training ``wall_s``), ``decision``,
``speeds`` and ``eval`` (test loss and accuracy with training wall time).
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import fmean

import torch

from omnilearn.asp.rules import Staleness
from omnilearn.experiments.config import TrainConfig
from omnilearn.balance.controllers import Decision
from omnilearn.observe.console import Console
from omnilearn.observe.rundir import MetricsLog, save_model, write_json
from omnilearn.runplan import RunPlan


class ASPLog:
    def __init__(self, cfg: TrainConfig, run: RunPlan, total_pushes: int, run_dir: Path | None) -> None:
        self.cfg, self.run, self.total, self.run_dir = cfg, run, total_pushes, run_dir
        self.log = MetricsLog(run_dir) if run_dir is not None else None
        self.console = Console(quiet=cfg.quiet)
        self.recent: list[dict] = []  # pushes since the last progress line
        self.pushes: list[dict] = []
        self.last_eval: dict = {}
        self.speed_changes: list[tuple[int, tuple[float, ...]]] = []
        self.decisions = 0
        self.start_s = 0.0

    def _write(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(record)

    def start(self, start_s: float) -> None:
        self.start_s = start_s

    def speeds(self, version: int, speeds: tuple[float, ...]) -> None:
        if self.speed_changes and speeds == self.speed_changes[-1][1]:
            return
        self.speed_changes.append((version, speeds))
        self._write({"event": "speeds", "version": version, "step": version // self.cfg.workers,
                     "speeds": list(speeds)})
        if version > 0:
            self.console.speeds(version, speeds)

    def push(self, version: int, worker: int, req, staleness: int, lr: float, wall_s: float, epochs: float) -> None:
        record = {"event": "push", "version": version, "rank": worker, "batch": req.batch, "staleness": staleness,
                  "pulled_version": req.pulled_version,
                  "cycle_s": req.cycle_s, "compute_s": req.compute_s, "loss": req.loss, "lr": lr, "wall_s": wall_s,
                  "epoch": epochs}
        self._write(record)
        self.pushes.append(record)
        self.recent.append(record)
        if len(self.recent) >= self.cfg.control_interval * self.cfg.workers or version == self.total:
            self._progress(version)

    def _progress(self, version: int) -> None:
        rows, self.recent = self.recent, []
        per = [[r for r in rows if r["rank"] == w] for w in range(self.cfg.workers)]
        stale = "/".join(f"{fmean(r['staleness'] for r in p):.1f}" if p else "-" for p in per)
        cycles = "/".join(f"{fmean(r['cycle_s'] for r in p) * 1e3:.0f}" if p else "-" for p in per)
        self.console.line(
            f"update {version:>6}/{self.total} | epoch {rows[-1]['epoch']:5.2f} | loss {fmean(r['loss'] for r in rows):.4f}"
            f" | batches {'/'.join(str(int(p[-1]['batch'])) if p else '-' for p in per)} | cycle ms {cycles}"
            f" | staleness {stale}", transient=True)
        if self.log is not None:
            self.log.flush()

    def decision(self, d: Decision) -> None:
        self._write({"event": "decision", "step": d.step, "old": list(d.old), "new": list(d.new),
                     "times_s": list(d.times_s), "changed": d.changed, "reason": d.reason})
        if d.changed:
            self.decisions += 1
            self.console.rebalance(d.step, d.step, d.old, d.new, d.times_s)

    def evaluation(self, epoch: int, version: int, wall_s: float, loss: float, accuracy: float) -> None:
        self.last_eval = {"epoch": epoch, "version": version, "step": version // self.cfg.workers, "wall_s": wall_s,
                          "test_loss": loss, "test_accuracy": accuracy}
        self._write({"event": "eval", **self.last_eval})

    def finish(self, wall_s: float, train_s: float, staleness: Staleness, model: torch.nn.Module,
               samples_dealt: int) -> dict:
        summary = {**self.summary(wall_s, train_s, staleness), "samples_dealt": samples_dealt}
        if self.run_dir is not None:
            write_json(self.run_dir / "summary.json", summary)
            save_model(self.run_dir, model)
        if self.log is not None:
            self.log.close()
        self.console.line(f"{'worker':>6} {'updates':>8} {'batch':>7} {'cycle ms':>9} {'staleness mean/max':>19} "
                           f"{'updates/s':>10}")
        for w in summary["workers"]:
            self.console.line(f"{w['rank']:>6} {w['updates']:>8} {w['mean_batch']:>7.1f} {w['mean_cycle_s'] * 1e3:>9.1f} "
                               f"{w['mean_staleness']:>10.2f}/{w['max_staleness']:<8} {w['updates_per_s']:>10.2f}")
        label = f"[asp {self.cfg.speeds} {self.cfg.controller}] " if self.cfg.quiet else ""
        self.console.info(f"{label}{summary['updates']} updates in {train_s:.1f} s | test accuracy "
                          f"{summary['test_accuracy']:.2%} | staleness mean {summary['mean_staleness']:.2f}, "
                          f"max {summary['max_staleness']}")
        if self.run_dir is not None and not self.cfg.quiet:
            self.console.info(f"run directory: {self.run_dir}")
        return summary

    def summary(self, wall_s: float, train_s: float, staleness: Staleness) -> dict:
        n = self.cfg.workers
        workers = []
        for w in range(n):
            mine = [p for p in self.pushes if p["rank"] == w]
            half = mine[len(mine) // 2 :] or mine
            workers.append({
                "rank": w, "updates": staleness.counts[w], "mean_staleness": staleness.mean(w),
                "max_staleness": staleness.maxima[w], "updates_per_s": staleness.counts[w] / train_s,
                "max_staleness_last_half": max((p["staleness"] for p in half), default=0),
                "mean_batch": fmean(p["batch"] for p in half) if half else 0.0,
                "mean_cycle_s": fmean(p["cycle_s"] for p in half) if half else 0.0,
                "mean_compute_s": fmean(p["compute_s"] for p in half) if half else 0.0,
            })
        updates = sum(staleness.counts)
        return {
            "mode": "asp", "updates": updates, "steps": updates // n, "wall_s": wall_s, "train_s": train_s,
            "samples_per_s": sum(p["batch"] for p in self.pushes) / train_s, "controller": self.cfg.controller,
            "lr_scaling": self.cfg.lr_scaling, "staleness_lr": self.cfg.staleness_lr, "rebalances": self.decisions,
            "test_accuracy": self.last_eval.get("test_accuracy"), "test_loss": self.last_eval.get("test_loss"),
            "final_train_loss": fmean(p["loss"] for p in self.pushes[-n:]) if self.pushes else None,
            "mean_staleness": sum(staleness.totals) / max(1, updates), "max_staleness": max(staleness.maxima),
            # after the controller's first decisions: the transient of the first intervals left out
            "max_staleness_last_half": max((p["staleness"] for p in self.pushes[len(self.pushes) // 2 :]), default=0),
            "declared_speeds": list(self.speed_changes[-1][1]) if len(self.speed_changes) == 1 else None,
            "speed_changes": [{"version": v, "speeds": list(s)} for v, s in self.speed_changes],
            "workers": workers, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
