"""Plots of a finished run or bench: PNGs from ``metrics.jsonl`` / ``bench.json`` only.

``render(path)`` looks at a directory and draws what it holds:

- a train run (``metrics.jsonl``, optional ``summary.json``) -> ``batches.png``,
  ``compute_wait.png``, ``step_time.png``, ``loss_accuracy.png``;
- a bench (``bench.json``) -> ``speedup.png``, ``efficiency.png`` (with
  min–max whiskers where rows carry ``spread`` over repeats);
- an ASP run or ``bench --mode asp`` -> see :mod:`omnilearn.experiments.report.asp`.

The PNGs are written next to the data and their paths returned. Reading and
per-step arithmetic live in :mod:`omnilearn.experiments.report.records` (pure,
tested); the drawing is in :mod:`omnilearn.experiments.report.plots`.
``write_tensorboard`` exports the same series as TensorBoard scalars when the
``tensorboard`` package is installed.

Run:  omnilearn report runs/demo   (or a bench directory)
Tests:  python -m pytest -q tests/unit/test_report.py
"""

from __future__ import annotations

import math
from pathlib import Path

from omnilearn.experiments.report import plots
from omnilearn.experiments.report.asp import render_asp_bench, render_asp_run, write_asp_tensorboard
from omnilearn.experiments.report.aspruns import is_asp_bench, is_asp_run
from omnilearn.experiments.report.records import (WINDOW, ReportError, load_bench, load_run, mean_step_s,
                                                  rolling_median, step_ideal_s, summary_writer, training_time_s)

ARM_ORDER = ("uniform", "static", "omnilearn", "model", "ddp")


def render_run(run_dir: Path) -> list[Path]:
    """Draw a train run's four PNGs into ``run_dir`` and return their paths."""
    run_dir = Path(run_dir)
    data = load_run(run_dir)
    step_ms = [mean_step_s(rs) * 1e3 for rs in data.rows_by_step]
    ideal_ms = [step_ideal_s(rs) * 1e3 for rs in data.rows_by_step]
    end_s = training_time_s([mean_step_s(rs) for rs in data.rows_by_step])
    eval_t = [_time_after(data.steps, end_s, e["step"]) for e in data.evals]
    eval_acc = [e.get("test_accuracy") for e in data.evals]
    eff = (data.summary or {}).get("balance_efficiency")
    smooth = lambda values: rolling_median(values, WINDOW)  # noqa: E731
    return [
        plots.batches(run_dir / "batches.png", data),
        plots.compute_wait(run_dir / "compute_wait.png", data, smooth),
        plots.step_time(run_dir / "step_time.png", data, smooth(step_ms), smooth(ideal_ms), eff),
        plots.loss_accuracy(run_dir / "loss_accuracy.png", end_s, data.loss_by_step, eval_t, eval_acc),
    ]


def _time_after(steps: list[int], end_s: list[float], n_steps: int) -> float:
    """Training time once ``n_steps`` steps are done (an eval's ``step`` counts finished steps)."""
    done = [t for s, t in zip(steps, end_s) if s < n_steps]
    return done[-1] if done else 0.0


def render_bench(bench_dir: Path) -> list[Path]:
    """Draw ``speedup.png`` and ``efficiency.png`` from ``bench.json``; a figure with no values is skipped."""
    bench_dir = Path(bench_dir)
    settings, results = load_bench(bench_dir)
    arms = [a for a in ARM_ORDER if any(r["arm"] == a for r in results)]
    arms += [a for a in dict.fromkeys(str(r["arm"]) for r in results) if a not in arms]
    speedup = _table(settings, arms, results, "speedup")
    for s in settings:  # uniform is the reference: 1.0 by definition
        if "uniform" in arms and (s, "uniform") in _present(results):
            speedup[s, "uniform"] = 1.0
    ideal = {s: _first_number(results, s, ["omnilearn", *arms], "ideal_speedup") for s in settings}
    out = []
    if any(v is not None for v in speedup.values()):
        out.append(plots.speedup(bench_dir / "speedup.png", settings, arms, speedup, ideal,
                                 _ranges(settings, arms, results, "speedup")))
    eff = _table(settings, arms, results, "balance_efficiency")
    if any(v is not None for v in eff.values()):
        out.append(plots.efficiency(bench_dir / "efficiency.png", settings, arms, eff,
                                    _ranges(settings, arms, results, "balance_efficiency")))
    return out


def _ranges(settings, arms, results, key) -> dict[tuple[str, str], tuple[float, float]]:
    """(min, max) over repeats of ``key`` per setting x arm, from a row's ``spread`` (benches of several repeats)."""
    out = {}
    for s in settings:
        for a in arms:
            row = _find(results, s, a) or {}
            span = (row.get("spread") or {}).get(key) if isinstance(row.get("spread"), dict) else None
            lo, hi = _number(span, "min"), _number(span, "max")
            if lo is not None and hi is not None and hi > lo:
                out[s, a] = (lo, hi)
    return out


def _present(results: list[dict]) -> set[tuple[str, str]]:
    return {(str(r["setting"]), str(r["arm"])) for r in results}


def _find(results: list[dict], setting: str, arm: str) -> dict | None:
    return next((r for r in results if str(r["setting"]) == setting and str(r["arm"]) == arm), None)


def _number(result: dict | None, key: str) -> float | None:
    v = None if result is None else result.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _first_number(results: list[dict], setting: str, arms: list[str], key: str) -> float | None:
    """``key`` of the first arm (in ``arms`` order) of ``setting`` that has a number for it."""
    values = (_number(_find(results, setting, a), key) for a in arms)
    return next((v for v in values if v is not None), None)


def _table(settings, arms, results, key) -> dict[tuple[str, str], float | None]:
    return {(s, a): _number(_find(results, s, a), key) for s in settings for a in arms}


def render(path: Path) -> list[Path]:
    """Draw a bench directory (``bench.json``) or a train run directory (``metrics.jsonl``)."""
    path = Path(path)
    if (path / "bench.json").is_file():
        return render_asp_bench(path) if is_asp_bench(path) else render_bench(path)
    if (path / "metrics.jsonl").is_file():
        return render_asp_run(path) if is_asp_run(path) else render_run(path)
    if path.is_dir():
        raise ReportError(f"{path} holds neither metrics.jsonl (a train run) nor bench.json (a bench run)")
    what = "is not a directory" if path.exists() else "does not exist"
    raise ReportError(f"{path} {what}; expected a directory holding metrics.jsonl (a train run) "
                      "or bench.json (a bench run)")


def write_tensorboard(run_dir: Path, logdir: Path) -> None:
    """Write a run's per-step scalars to ``logdir`` for TensorBoard (needs the ``tensorboard`` package)."""
    if (Path(run_dir) / "metrics.jsonl").is_file() and is_asp_run(Path(run_dir)):
        return write_asp_tensorboard(Path(run_dir), logdir)
    data = load_run(Path(run_dir))
    writer = summary_writer(logdir)
    try:
        for i, step in enumerate(data.steps):
            for rank in data.ranks:
                for field, tag, scale in (("batch", "batch", 1.0), ("compute_s", "compute_ms", 1e3),
                                          ("wait_s", "wait_ms", 1e3)):
                    value = data.per_rank[field][rank][i]
                    if not math.isnan(value):
                        writer.add_scalar(f"rank{rank}/{tag}", value * scale, step)
            writer.add_scalar("train/loss", data.loss_by_step[i], step)
            writer.add_scalar("step/measured_ms", mean_step_s(data.rows_by_step[i]) * 1e3, step)
            writer.add_scalar("step/ideal_ms", step_ideal_s(data.rows_by_step[i]) * 1e3, step)
        for e in data.evals:
            if isinstance(e.get("test_accuracy"), (int, float)):
                writer.add_scalar("test/accuracy", e["test_accuracy"], e["step"])
    finally:
        writer.close()
