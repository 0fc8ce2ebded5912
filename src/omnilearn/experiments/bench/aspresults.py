"""``omnilearn bench --mode asp``'s figures: one finished arm read back from its run directory (:func:`measure`),
each arm's repeats merged into one row (:func:`merge`), accuracy at equal epochs (:func:`add_equal_epochs`).

The run directory is either runtime's (PyTorch's parameter server or TensorFlow's chief write the same record:
``summary.json``, ``metrics.jsonl``). Run: ``python -m pytest -q tests/unit/test_benchstats.py``
"""

from __future__ import annotations

import json
from statistics import fmean
from typing import Callable

from omnilearn.experiments.bench.bsp import Arm
from omnilearn.experiments.bench.stats import (SMOOTH_EVALS, accuracy_at_epochs, accuracy_by_budget, add_histograms,
                                              epoch_accuracies, equal_epochs, eval_points, spread, staleness_histogram,
                                              time_to_accuracy)
from omnilearn.observe.metrics import read_metrics

ARMS = ("uniform", "omnilearn", "bsp")  # the row order
REPEATED = ("test_accuracy", "accuracy_at_budget", "accuracy_at_budget_s", "accuracy_at_equal_epochs",
            "time_to_accuracy_s", "train_s")
PER_WORKER_MEANS = ("mean_staleness_per_worker", "updates_per_s_per_worker", "mean_batch_per_worker",
                    "mean_cycle_s_per_worker", "mean_compute_s_per_worker")



def measure(arm: Arm, budget_s: float, target: float | None) -> dict:
    """The figures of one finished arm, read back from its run directory."""
    cfg, run_dir = arm.job.cfg, arm.job.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir)
    points = eval_points(records)
    at_budget, at_budget_s = accuracy_by_budget(points, budget_s, SMOOTH_EVALS)
    out = {"setting": arm.setting, "arm": arm.arm, "repeat": arm.repeat, "seed": cfg.seed, "run_dir": str(run_dir),
           "levels": cfg.mode, "train_s": summary["train_s"], "test_accuracy": summary.get("test_accuracy"),
           "accuracy_at_budget": at_budget, "accuracy_at_budget_s": at_budget_s,
           "samples_per_s": summary["samples_per_s"],
           "time_to_accuracy_s": time_to_accuracy([{"wall_s": t, "test_accuracy": a} for t, a in points], target),
           "accuracy_curve": [list(p) for p in points],
           "epoch_accuracy": epoch_accuracies(records)}
    if cfg.mode == "bsp":  # synchronous: every gradient is computed on the current weights
        rate = summary["steps"] / summary["train_s"]
        workers = summary.get("workers") or []
        return {**out, "updates": summary["steps"], "mean_staleness": 0.0, "max_staleness": 0, "p99_staleness": 0,
                "mean_staleness_per_worker": [0.0] * cfg.workers, "max_staleness_per_worker": [0] * cfg.workers,
                "p99_staleness_per_worker": [0] * cfg.workers,
                "updates_per_s_per_worker": [rate] * cfg.workers,
                "mean_batch_per_worker": [w["mean_batch"] for w in workers] or None,
                "mean_cycle_s_per_worker": None,
                "mean_compute_s_per_worker": [w["mean_compute_s"] for w in workers] or None,
                "staleness_histogram": None}
    ws = summary["workers"]
    pushes = [r for r in records if r.get("event") == "push"]
    return {**out, "updates": summary["updates"], "mean_staleness": summary["mean_staleness"],
            "max_staleness": summary["max_staleness"], "p99_staleness": summary["p99_staleness"],
            "mean_staleness_per_worker": [w["mean_staleness"] for w in ws],
            "max_staleness_per_worker": [w["max_staleness"] for w in ws],
            "p99_staleness_per_worker": [w["p99_staleness"] for w in ws],
            "updates_per_s_per_worker": [w["updates_per_s"] for w in ws],
            "mean_batch_per_worker": [w["mean_batch"] for w in ws],
            "mean_cycle_s_per_worker": [w["mean_cycle_s"] for w in ws],
            "mean_compute_s_per_worker": [w["mean_compute_s"] for w in ws],
            "staleness_histogram": staleness_histogram(pushes, cfg.workers)}


def _columns(lists: list, combine: Callable) -> list | None:
    if any(v is None for v in lists):
        return None
    return [combine(col) for col in zip(*lists)]


def add_equal_epochs(results: list[dict]) -> None:
    """Per setting and repeat: ``equal_epochs`` (whole epochs every arm reached) and each arm's accuracy there."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["repeat"]), []).append(r)
    for rs in groups.values():
        epochs = equal_epochs([r["epoch_accuracy"] for r in rs])
        for r in rs:
            r["equal_epochs"] = epochs
            r["accuracy_at_equal_epochs"] = accuracy_at_epochs(r["epoch_accuracy"], epochs, SMOOTH_EVALS)


def merge(results: list[dict], settings: tuple[str, ...], budget_s: float) -> list[dict]:
    """One row per setting x arm: repeats kept per figure (``per_repeat``) with mean, min and max."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["arm"]), []).append(r)
    rows = []
    for (setting, arm), rs in sorted(groups.items(), key=lambda kv: (settings.index(kv[0][0]), ARMS.index(kv[0][1]))):
        rs = sorted(rs, key=lambda r: r["repeat"])
        row = {"setting": setting, "arm": arm, "levels": rs[0]["levels"], "repeats": len(rs),
               "seeds": [r["seed"] for r in rs], "run_dirs": [r["run_dir"] for r in rs],
               "equal_epochs": [r.get("equal_epochs") for r in rs]}
        for key in REPEATED:
            row[key] = {**spread([r.get(key) for r in rs]), "per_repeat": [r.get(key) for r in rs]}
        row.update(updates=fmean(r["updates"] for r in rs), samples_per_s=fmean(r["samples_per_s"] for r in rs),
                   mean_staleness=fmean(r["mean_staleness"] for r in rs),
                   max_staleness=max(r["max_staleness"] for r in rs),
                   max_staleness_per_worker=_columns([r["max_staleness_per_worker"] for r in rs], max),
                   p99_staleness=max(r["p99_staleness"] for r in rs),  # the worst repeat's
                   p99_staleness_per_worker=_columns([r["p99_staleness_per_worker"] for r in rs], max),
                   covers_budget=all(r["train_s"] >= 0.98 * budget_s for r in rs))
        for key in PER_WORKER_MEANS:
            row[key] = _columns([r[key] for r in rs], fmean)
        hists = [r["staleness_histogram"] for r in rs]
        row["staleness_histogram"] = None if None in hists else add_histograms(hists)
        row["accuracy_curves"] = [r["accuracy_curve"] for r in rs]
        rows.append(row)
    return rows
