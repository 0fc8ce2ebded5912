"""Reading an ASP run for the plots: ``push`` events of ``metrics.jsonl`` in, per-worker series out.

Pure (no matplotlib): :mod:`omnilearn.experiments.report.asp` renders what
this module reads, :mod:`.aspplots` draws it, both import from here. Time is
training time: a push's ``wall_s`` (evaluation excluded). Usage::

    data = load_asp_run(Path("runs/asp-demo"))   # AspRunData
    centres, rates = push_rates({k: [p["wall_s"] for p in ps] for k, ps in data.pushes.items()})

Run its tests:  python -m pytest -q tests/unit/test_report.py
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omnilearn.experiments.bench.stats import eval_points, staleness_histogram
from omnilearn.experiments.report.records import WINDOW, ReportError, read_jsonl, rolling_median

Series = dict[int, tuple[list[float], list[float]]]  # rank -> (training time s, values)
PUSH_FIELDS = ("version", "rank", "batch", "staleness", "cycle_s", "compute_s", "wall_s")
RATE_BINS = 40
PUSHES_PER_BIN = 10


@dataclass(frozen=True)
class AspRunData:
    """An ASP run's pushes per worker (in version order) and its events placed on the training-time axis."""

    ranks: list[int]
    pushes: dict[int, list[dict[str, Any]]]
    loss: tuple[list[float], list[float]]  # (time s, rolling median of the pushes' losses), all workers
    speed_changes: list[tuple[float, list[float]]]  # (time s, new speeds); what plots.mark_events draws
    rebalances: list[float]  # time s of applied controller changes
    evals: list[tuple[float, float]]  # (time s, test accuracy)
    histogram: list[list[int]]  # staleness counts per worker
    summary: dict[str, Any] | None

    def series(self, field: str, scale: float = 1.0, window: int = 1) -> Series:
        """Per worker: (time s, ``field`` x ``scale``), a centred rolling median of ``window`` pushes."""
        out = {}
        for rank, ps in self.pushes.items():
            ys = [float(p[field]) * scale for p in ps]
            out[rank] = ([float(p["wall_s"]) for p in ps], rolling_median(ys, window) if window > 1 else ys)
        return out


def push_rates(times: dict[int, Sequence[float]],
               bins: int | None = None) -> tuple[list[float], dict[int, list[float]]]:
    """Pushes per second per worker in equal slices of training time: (slice centres, rates).

    ``bins`` defaults to about ``PUSHES_PER_BIN`` pushes per worker and slice, at most ``RATE_BINS`` slices.
    """
    end = max((t for ts in times.values() for t in ts), default=0.0)
    if bins is None:
        pushes = sum(len(ts) for ts in times.values()) / max(1, len(times))
        bins = int(min(RATE_BINS, max(1, pushes // PUSHES_PER_BIN)))
    bins = bins if end > 0 else 1
    width = end / bins if end > 0 else 1.0
    rates = {}
    for rank, ts in times.items():
        counts = [0] * bins
        for t in ts:
            counts[min(bins - 1, int(t / width))] += 1
        rates[rank] = [c / width for c in counts]
    return [(k + 0.5) * width for k in range(bins)], rates


def read_summary(run_dir: Path) -> dict | None:
    """``summary.json`` of a run as a dict, None when missing or unreadable."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


def is_asp_run(run_dir: Path) -> bool:
    summary = read_summary(Path(run_dir))
    if summary is not None and "mode" in summary:
        return summary["mode"] == "asp"
    with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as f:
        return any('"push"' in line and json.loads(line).get("event") == "push" for line in f if line.strip())


def is_asp_bench(bench_dir: Path) -> bool:
    try:
        data = json.loads((Path(bench_dir) / "bench.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False  # load_bench names the problem
    return isinstance(data, dict) and data.get("train_mode") == "asp"


def _pushes(path: Path, records: list[dict]) -> list[dict]:
    pushes = [r for r in records if r.get("event") == "push"]
    for p in pushes:
        if not all(isinstance(p.get(k), (int, float)) for k in PUSH_FIELDS):
            raise ReportError(f"{path}: a push record lacks one of {', '.join(PUSH_FIELDS)}: {p}")
    if not pushes:
        raise ReportError(f"{path} holds no push records; nothing to plot")
    return sorted(pushes, key=lambda p: p["version"])


def load_asp_run(run_dir: Path) -> AspRunData:
    path = Path(run_dir) / "metrics.jsonl"
    records = read_jsonl(path)
    pushes = _pushes(path, records)
    versions, times = [p["version"] for p in pushes], [float(p["wall_s"]) for p in pushes]

    def at(version: int) -> float:  # training time once ``version`` updates were applied
        k = bisect.bisect_right(versions, version)
        return times[k - 1] if k else 0.0

    changes, last = [], None
    for r in records:
        if r.get("event") == "speeds" and isinstance(r.get("speeds"), list):
            if r.get("version", 0) > 0 and r["speeds"] != last:
                changes.append((at(int(r["version"])), [float(s) for s in r["speeds"]]))
            last = r["speeds"]
    rebalances = [at(int(r["step"])) for r in records
                  if r.get("event") == "decision" and r.get("changed") and isinstance(r.get("step"), int)]
    ranks = sorted({int(p["rank"]) for p in pushes})
    losses = [float(p["loss"]) if isinstance(p.get("loss"), (int, float)) else float("nan") for p in pushes]
    loss = (times, rolling_median(losses, WINDOW * len(ranks)))
    return AspRunData(ranks, {k: [p for p in pushes if p["rank"] == k] for k in ranks}, loss, changes, rebalances,
                      eval_points(records), staleness_histogram(pushes, max(ranks) + 1), read_summary(Path(run_dir)))
