"""``omnilearn simulate --from-bench DIR``: calibrate on a bench's fixed arms, predict its controller arms.

Calibration uses only the ``uniform`` and ``static`` arms of one setting
(they ran different batches on every worker at HL > 1), every repeat, steps
from the first control interval on:

- per worker a least-squares line ``compute_s = alpha_i + beta_i * b`` through
  each run's median ``compute_s`` at its batch (one distinct batch: through 0);
- noise: whole steps resampled, each worker's ``compute_s`` over its run's
  median (a shared host's slowdowns stay correlated), with that step's sync
  (the slowest worker's ``wait_s``: what the all-reduce adds to the step);
- the per-step time outside the steps (data, control work): the bench's wall
  step minus its mean in-step time, median over the calibration runs.

Then every arm (the fixed ones too, as a check of the fit) runs through the
library's ControlLoop with the bench's global batch, steps, control interval,
deadband and bounds, over ``seeds`` draws, and each figure is compared on the
bench's own steady range: step ms (wall), speed-up over uniform (paired per
seed), balance efficiency (the bench's ``T* = B / sum(v_i) + min wait``).

Run: ``omnilearn simulate --from-bench runs/bench-quick --setting HL8``
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnilearn.config import ConfigError
from omnilearn.emulation.speeds import BSP_LEVELS
from omnilearn.experiments.bench.stats import (rows_from_records, steady_wall_step_s)
from omnilearn.experiments.simulate.model import Scenario
from omnilearn.experiments.simulate.run import run_controller
from omnilearn.observe.metrics import read_metrics

CALIBRATION_ARMS = ("uniform", "static")
PREFETCH_FACTOR = 2  # a DataLoader's default: the runtime's lag is ceil(loader_workers * 2 / accumulation)


@dataclass(frozen=True)
class Run:
    """One measured run, as arrays over its steps from ``skip`` on: (steps, n) batch and compute, (steps,) sync."""

    arm: str
    batch: np.ndarray
    compute_s: np.ndarray
    sync_s: np.ndarray
    in_step_s: float  # mean step over the steady range
    wall_step_s: float | None


def load_bench(out: Path) -> dict:
    path = Path(out) / "bench.json"
    if not path.is_file():
        raise ConfigError(f"--from-bench {str(out)!r} holds no bench.json; give the --out of an `omnilearn bench`")
    bench = json.loads(path.read_text())
    if bench.get("mode") == "asp" or "results" not in bench:
        raise ConfigError(f"--from-bench {str(out)!r}: only a BSP bench can calibrate the simulator")
    return bench


def run_dirs(out: Path, bench: dict, setting: str, arm: str) -> list[Path]:
    for r in bench["results"]:
        if r.get("setting") == setting and r.get("arm") == arm and r.get("run_dirs"):
            return [Path(d) if Path(d).is_dir() else Path(out) / Path(d).name for d in r["run_dirs"]]
    return sorted(p for p in Path(out).glob(f"{setting}-{arm}*") if (p / "metrics.jsonl").is_file())


def read_run(run_dir: Path, arm: str, skip: int, first: int) -> Run:
    """The step records of ``run_dir`` as arrays (from step ``skip`` on) and its measured steady figures."""
    records = read_metrics(run_dir)
    rows = sorted(rows_from_records(records), key=lambda r: (r.step, r.rank))
    n = 1 + max(r.rank for r in rows)
    steps = sorted({r.step for r in rows})
    grid = np.full((3, len(steps), n), np.nan)
    step_s = np.full((len(steps), n), np.nan)
    where = {s: k for k, s in enumerate(steps)}
    for r in rows:
        k = where[r.step]
        grid[:, k, r.rank] = r.batch, r.compute_s, r.wait_s
        step_s[k, r.rank] = r.step_s
    keep = np.isfinite(grid).all(axis=(0, 2)) & (np.asarray(steps) >= skip)
    steady = np.isfinite(step_s).all(axis=1) & (np.asarray(steps) >= first)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    evals = [r for r in records if r.get("event") == "eval"]
    wall = (steady_wall_step_s(evals, first, summary["steps"], summary["train_s"])
            if "steps" in summary and "train_s" in summary else None)
    return Run(arm, grid[0, keep], grid[1, keep], np.nanmin(grid[2, keep], axis=1),
               float(np.mean(step_s[steady].mean(axis=1))), wall)


def fit_lines(runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
    """Per worker: least squares through each run's (median batch, median compute) point."""
    b = np.array([np.median(r.batch, axis=0) for r in runs])
    t = np.array([np.median(r.compute_s, axis=0) for r in runs])
    alpha, beta = np.zeros(b.shape[1]), np.zeros(b.shape[1])
    for i in range(b.shape[1]):
        if np.ptp(b[:, i]) > 0:
            beta[i], alpha[i] = np.polyfit(b[:, i], t[:, i], 1)
        if np.ptp(b[:, i]) == 0 or alpha[i] < 0 or beta[i] <= 0:  # one batch, or a line through 0 fits better
            alpha[i], beta[i] = 0.0, float(np.sum(b[:, i] * t[:, i]) / np.sum(b[:, i] ** 2))
    return alpha, beta


def train_config(run_dir: Path) -> dict:
    path = run_dir / "config.toml"
    if not path.is_file():
        return {}
    doc = tomllib.loads(path.read_text())
    return doc.get("train", doc)


def calibrate(out: Path, setting: str | None = None, seed: int = 0) -> tuple[Scenario, dict]:
    """A :class:`Scenario` fitted on the fixed arms of ``setting``, and the bench's facts (steps, arms, measured)."""
    bench = load_bench(out)
    fixed = [s for s in bench.get("settings", []) if s.upper() in BSP_LEVELS and s.upper() != "HL1"]
    setting = (setting or (fixed[-1] if fixed else "HL8")).upper()
    if setting not in bench.get("settings", []) or setting not in BSP_LEVELS:
        ran = ", ".join(bench.get("settings", []))
        raise ConfigError(f"--setting {setting!r}: the bench at {str(out)!r} ran {ran}; "
                          "choose a fixed level it ran (HL2, HL4, HL8)")
    interval, steps = int(bench["control_interval"]), int(bench["steps"])
    measured = {r["arm"]: r for r in bench["results"] if r.get("setting") == setting}
    first = int(next(iter(measured.values()), {}).get("figures_from_step", steps // 2))
    runs = [read_run(d, arm, interval, first) for arm in CALIBRATION_ARMS for d in run_dirs(out, bench, setting, arm)]
    if len({tuple(np.median(r.batch, axis=0)) for r in runs}) < 2:
        raise ConfigError(f"--from-bench needs the uniform and static arms of {setting} at two batches per worker "
                          "(at HL1 they run the same batches: calibrate on HL2, HL4 or HL8)")
    alpha, beta = fit_lines(runs)
    residuals = np.concatenate([r.compute_s / np.median(r.compute_s, axis=0) for r in runs])
    gaps = [r.wall_step_s - r.in_step_s for r in runs if r.wall_step_s is not None]
    cfg = train_config(run_dirs(out, bench, setting, CALIBRATION_ARMS[0])[0])
    max_batch = cfg.get("max_batch")
    sc = Scenario(alpha, beta, int(bench["global_batch"]), steps, BSP_LEVELS[setting],
                  residuals=residuals, sync_samples=np.concatenate([r.sync_s for r in runs]),
                  gap_s=max(0.0, float(np.median(gaps))) if gaps else 0.0,
                  min_batch=int(cfg.get("min_batch", 1)),
                  max_batch=max_batch if isinstance(max_batch, int) else None, interval=interval,
                  lag=math.ceil(int(cfg.get("loader_workers", 0)) * PREFETCH_FACTOR
                                / int(cfg.get("accumulation_steps", 1))),
                  deadband=float(cfg.get("deadband", 0.05)), seed=seed)
    facts = {"setting": setting, "first_step": first, "arms": [a for a in bench.get("arms", []) if a in measured],
             "measured": measured, "calibration_runs": len(runs), "repeats": bench.get("repeats")}
    return sc, facts


def predict(sc: Scenario, facts: dict, seeds: int = 8) -> list[dict]:
    """Per arm: predicted vs measured step ms, speed-up over uniform and balance efficiency, with relative errors."""
    first, arms = facts["first_step"], facts["arms"]
    sims: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    for k in range(seeds):
        s = dataclasses.replace(sc, seed=sc.seed + k)
        for arm in arms:
            t = run_controller(s, arm)
            sims[arm].append((float(t.step_s[first:].mean()) + sc.gap_s,
                              float(t.bench_ideal_s[first:].mean() / t.step_s[first:].mean())))
    out = []
    for arm in arms:
        step = np.array([x for x, _ in sims[arm]])
        base = np.array([x for x, _ in sims["uniform"]]) if "uniform" in sims else None
        m = facts["measured"][arm]
        pred = {"step_ms": 1e3 * step.mean(), "speedup": float(np.mean(base / step)) if base is not None else None,
                "balance_efficiency": float(np.mean([e for _, e in sims[arm]]))}
        meas = {"step_ms": 1e3 * m["mean_step_s"], "speedup": m.get("speedup"),
                "balance_efficiency": m.get("balance_efficiency")}
        row = {"arm": arm, "role": "calibration" if arm in CALIBRATION_ARMS else "prediction"}
        for key in pred:
            p, q = pred[key], meas[key]
            row[key] = {"predicted": p, "measured": q,
                        "error": (p - q) / q if p is not None and q not in (None, 0) else None}
        out.append(row)
    return out
