"""Plots of a finished run or bench: PNGs from ``metrics.jsonl`` / ``bench.json`` only.

``render(path)`` looks at a directory and draws what it holds:

- a train run (``metrics.jsonl``, optional ``summary.json``) -> ``batches.png``,
  ``compute_wait.png``, ``step_time.png``, ``loss_accuracy.png``;
- a bench (``bench.json``) -> ``speedup.png``, ``efficiency.png``;
- an ASP run or ``bench --mode asp`` -> see :mod:`omnilearn.experiments.report.asp`.

The PNGs are written next to the data and their paths returned. Reading and
per-step arithmetic live here (pure, tested); the drawing is in
``omnilearn.experiments.report.plots``. ``write_tensorboard`` exports the same series as
TensorBoard scalars when the ``tensorboard`` package is installed.

Run:  omnilearn report runs/demo   (or a bench directory)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, never a window; must precede any pyplot import

from omnilearn.experiments.report import plots  # noqa: E402  (imports pyplot)
from omnilearn.balance.efficiency import StepRow, ideal_step_s  # noqa: E402

NAN = float("nan")
STEP_FIELDS = ("step", "rank", "batch", "compute_s", "wait_s", "step_s")
ARM_ORDER = ("uniform", "static", "omnilearn", "ddp")


class ReportError(ValueError):
    """The directory or its files cannot be drawn."""


@dataclass(frozen=True)
class RunData:
    """A run's per-step series. ``per_rank[field][rank]`` aligns with ``steps`` (NaN where missing)."""

    steps: list[int]
    ranks: list[int]
    per_rank: dict[str, dict[int, list[float]]]
    rows_by_step: list[list[StepRow]]
    loss_by_step: list[float]
    speed_changes: list[tuple[int, list[float]]]
    rebalances: list[int]
    evals: list[dict[str, Any]]
    summary: dict[str, Any] | None


# ---------------------------------------------------------------- pure helpers

def rolling_median(values: Sequence[float], window: int = 5) -> list[float]:
    """Centred rolling median (window clipped at the ends); NaNs are ignored, an all-NaN window gives NaN."""
    half = window // 2
    out = []
    for i in range(len(values)):
        vals = [v for v in values[max(0, i - half): i + half + 1] if not math.isnan(v)]
        out.append(median(vals) if vals else NAN)
    return out


def step_ideal_s(rows: Sequence[StepRow]) -> float:
    """``T*`` of one step (``efficiency.ideal_step_s``), NaN when no worker has a positive compute time."""
    if not rows or not any(r.compute_s > 0 for r in rows):
        return NAN
    return ideal_step_s(rows)


def weighted_loss(losses: Sequence[float], batches: Sequence[float]) -> float:
    """Loss over the global batch: ``sum_i loss_i * b_i / sum_i b_i``."""
    total = sum(batches)
    return sum(x * b for x, b in zip(losses, batches)) / total if total > 0 else NAN


def training_time_s(step_s: Sequence[float]) -> list[float]:
    """Training time at the end of each step: cumulative sum of step durations (NaN counts as 0)."""
    out, t = [], 0.0
    for s in step_s:
        t += 0.0 if math.isnan(s) else s
        out.append(t)
    return out


def mean_step_s(rows: Sequence[StepRow]) -> float:
    return sum(r.step_s for r in rows) / len(rows) if rows else NAN


# ---------------------------------------------------------------- reading

def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReportError(f"{path}: line {n} is not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ReportError(f"{path}: line {n} is not a JSON object")
            records.append(rec)
    return records


def _step_rows(path: Path, records: list[dict[str, Any]]) -> tuple[list[StepRow], dict[tuple[int, int], float]]:
    rows, loss = [], {}
    for rec in records:
        try:
            row = StepRow(*(int(rec[k]) if k in ("step", "rank", "batch") else float(rec[k]) for k in STEP_FIELDS))
        except (KeyError, TypeError, ValueError):
            raise ReportError(f"{path}: a step record lacks one of {', '.join(STEP_FIELDS)}: {rec}") from None
        rows.append(row)
        value = rec.get("loss")
        loss[row.step, row.rank] = float(value) if isinstance(value, (int, float)) else NAN
    if not rows:
        raise ReportError(f"{path} holds no step records; nothing to plot")
    return rows, loss


def _events(records: list[dict[str, Any]]) -> tuple[list[tuple[int, list[float]]], list[int], list[dict]]:
    changes, last = [], None
    for rec in records:
        if rec.get("event") == "speeds" and isinstance(rec.get("speeds"), list):
            if rec.get("step", 0) > 0 and rec["speeds"] != last:
                changes.append((int(rec["step"]), [float(s) for s in rec["speeds"]]))
            last = rec["speeds"]
    rebalances = sorted({int(r["effective_step"]) for r in records if r.get("event") == "decision"
                         and r.get("changed") and isinstance(r.get("effective_step"), int)})
    evals = sorted((r for r in records if r.get("event") == "eval" and isinstance(r.get("step"), int)),
                   key=lambda r: r["step"])
    return changes, rebalances, evals


def load_run(run_dir: Path) -> RunData:
    """Read ``metrics.jsonl`` (and ``summary.json`` when present) into per-step series."""
    path = Path(run_dir) / "metrics.jsonl"
    records = _read_jsonl(path)
    rows, loss = _step_rows(path, [r for r in records if r.get("event") == "step"])
    steps = sorted({r.step for r in rows})
    ranks = sorted({r.rank for r in rows})
    index = {s: i for i, s in enumerate(steps)}
    per_rank = {f: {k: [NAN] * len(steps) for k in ranks} for f in ("batch", "compute_s", "wait_s", "loss")}
    rows_by_step: list[list[StepRow]] = [[] for _ in steps]
    for r in rows:
        i = index[r.step]
        rows_by_step[i].append(r)
        for f in ("batch", "compute_s", "wait_s"):
            per_rank[f][r.rank][i] = float(getattr(r, f))
        per_rank["loss"][r.rank][i] = loss[r.step, r.rank]
    loss_by_step = [weighted_loss([loss[r.step, r.rank] for r in rs], [r.batch for r in rs]) for rs in rows_by_step]
    changes, rebalances, evals = _events(records)
    summary = None
    if (Path(run_dir) / "summary.json").is_file():
        try:
            summary = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            summary = None  # an interrupted write; the plots need only metrics.jsonl
    return RunData(steps, ranks, per_rank, rows_by_step, loss_by_step, changes, rebalances, evals,
                   summary if isinstance(summary, dict) else None)


def load_bench(bench_dir: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Settings (in order) and result rows of ``bench.json``."""
    path = Path(bench_dir) / "bench.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ReportError(f"{path} is not JSON ({e.msg})") from None
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list) or not results:
        raise ReportError(f"{path} holds no \"results\" list; expected {{\"settings\": [...], \"results\": [...]}}")
    results = [r for r in results if isinstance(r, dict) and "setting" in r and "arm" in r]
    if not results:
        raise ReportError(f"{path}: no result has both \"setting\" and \"arm\"")
    settings = [str(s) for s in data.get("settings") or []]
    settings += [s for s in dict.fromkeys(str(r["setting"]) for r in results) if s not in settings]
    return settings, results


# ---------------------------------------------------------------- rendering

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
    smooth = lambda values: rolling_median(values, plots.WINDOW)  # noqa: E731
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
        out.append(plots.speedup(bench_dir / "speedup.png", settings, arms, speedup, ideal))
    eff = _table(settings, arms, results, "balance_efficiency")
    if any(v is not None for v in eff.values()):
        out.append(plots.efficiency(bench_dir / "efficiency.png", settings, arms, eff))
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
    from omnilearn.experiments.report import asp as aspreport  # ASP runs and benches (it imports this module)

    path = Path(path)
    if (path / "bench.json").is_file():
        return aspreport.render_asp_bench(path) if aspreport.is_asp_bench(path) else render_bench(path)
    if (path / "metrics.jsonl").is_file():
        return aspreport.render_asp_run(path) if aspreport.is_asp_run(path) else render_run(path)
    if path.is_dir():
        raise ReportError(f"{path} holds neither metrics.jsonl (a train run) nor bench.json (a bench run)")
    what = "is not a directory" if path.exists() else "does not exist"
    raise ReportError(f"{path} {what}; expected a directory holding metrics.jsonl (a train run) "
                      "or bench.json (a bench run)")


def summary_writer(logdir: Path):
    """A TensorBoard ``SummaryWriter`` into ``logdir``; a one-line error without the package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ReportError("writing TensorBoard scalars needs the tensorboard package: "
                          "pip install tensorboard") from None
    return SummaryWriter(log_dir=str(logdir))


def write_tensorboard(run_dir: Path, logdir: Path) -> None:
    """Write a run's per-step scalars to ``logdir`` for TensorBoard (needs the ``tensorboard`` package)."""
    from omnilearn.experiments.report import asp as aspreport

    if (Path(run_dir) / "metrics.jsonl").is_file() and aspreport.is_asp_run(Path(run_dir)):
        return aspreport.write_asp_tensorboard(Path(run_dir), logdir)
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
