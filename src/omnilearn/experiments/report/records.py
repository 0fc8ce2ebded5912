"""Reading a finished run or bench for the plots: ``metrics.jsonl`` / ``summary.json`` / ``bench.json`` in, series out.

The base of :mod:`omnilearn.experiments.report`: pure (no matplotlib), imported
by the drawing (:mod:`.plots`, :mod:`.aspplots`), the ASP reading
(:mod:`.aspruns`) and the renderers (:mod:`.runs`, :mod:`.asp`), and importing
none of them. Usage::

    data = load_run(Path("runs/demo"))        # RunData: per-step, per-rank series
    settings, results = load_bench(Path("runs/bench"))

``metrics.jsonl`` is read through :func:`read_jsonl`: a last line cut by a
crash is skipped with a warning, and a resumed run reads as one run (each
step once, what the resumed run redid replaced: :func:`replay`).

Run its tests:  python -m pytest -q tests/unit/test_report.py
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Sequence

from omnilearn.balance.efficiency import StepRow, ideal_step_s
from omnilearn.observe.metrics import parse_jsonl, read_rank_rows, replay  # replay: re-exported, every reader's rule
from omnilearn.observe.rundir import RunDirError

NAN = float("nan")
STEP_FIELDS = ("step", "rank", "batch", "compute_s", "wait_s", "step_s")
WINDOW = 5  # steps (pushes) in the rolling medians of the plots


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

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` as the run stands; a bad line raises :class:`ReportError` naming it.

    Every reader here and in :mod:`.aspruns` / :mod:`.asp` comes through this: a last line cut by a crash is
    left out with one warning (:func:`omnilearn.observe.metrics.parse_jsonl`), and of a resumed run only the
    records the resumed run did not redo are kept (:func:`replay`, the one rule the library's
    ``read_metrics`` follows too), so each step is read once.
    """
    try:  # BSP's step rows are in each rank's file beside it
        return replay(parse_jsonl(path)) + read_rank_rows(Path(path).parent)
    except RunDirError as e:
        raise ReportError(str(e)) from None


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
    records = read_jsonl(path)
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


def summary_writer(logdir: Path):
    """A TensorBoard ``SummaryWriter`` into ``logdir``; a one-line error without the package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ReportError("writing TensorBoard scalars needs the tensorboard package: "
                          "pip install tensorboard") from None
    return SummaryWriter(log_dir=str(logdir))
