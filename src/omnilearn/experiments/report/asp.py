"""Plots of an ASP run or of ``bench --mode asp``: PNGs from ``metrics.jsonl`` / ``bench.json`` only.

:func:`omnilearn.experiments.report.runs.render` hands over here when a run's ``summary.json``
says ``"mode": "asp"`` or its ``metrics.jsonl`` holds ``push`` events, and
when ``bench.json`` says ``"train_mode": "asp"``:

- an ASP run -> ``batches.png`` (per-worker batch over training time),
  ``cycle_compute.png``, ``update_rate.png``, ``loss_accuracy.png`` and
  ``staleness.png`` (a staleness histogram per worker);
- an ASP bench -> ``accuracy.png`` (accuracy at the budget per setting and
  arm), ``accuracy-<setting>.png`` (accuracy over training time per arm) and
  ``staleness-<setting>.png`` (per-worker histograms, one panel per ASP arm).

Time is training time: a push's ``wall_s`` (evaluation excluded). Reading and
arithmetic here (pure, tested); drawing in :mod:`omnilearn.experiments.report.aspplots`.

Run:  omnilearn report runs/asp-demo   (or a bench --mode asp directory)
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omnilearn.experiments.report import aspplots
from omnilearn.experiments.benchstats import eval_points, staleness_histogram
from omnilearn.experiments.report.plots import WINDOW
from omnilearn.experiments.report.runs import ReportError, _read_jsonl, load_bench, rolling_median

PUSH_FIELDS = ("version", "rank", "batch", "staleness", "cycle_s", "compute_s", "wall_s")
ARM_ORDER = ("uniform", "omnilearn", "bsp")
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

    def series(self, field: str, scale: float = 1.0, window: int = 1) -> aspplots.Series:
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


def _summary(run_dir: Path) -> dict | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


def is_asp_run(run_dir: Path) -> bool:
    summary = _summary(Path(run_dir))
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
    records = _read_jsonl(path)
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
                      eval_points(records), staleness_histogram(pushes, max(ranks) + 1), _summary(Path(run_dir)))


def render_asp_run(run_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    data = load_asp_run(run_dir)
    centres, rates = push_rates({k: [p["wall_s"] for p in ps] for k, ps in data.pushes.items()})
    means = [f"mean {sum(s * c for s, c in enumerate(h)) / max(1, sum(h)):.2f}, max "
             f"{max((s for s, c in enumerate(h) if c), default=0)}" for h in data.histogram]
    from omnilearn.experiments.report import plots

    return [
        aspplots.worker_series(run_dir / "batches.png", data, data.series("batch", window=3), "local batch (samples)",
                               "Per-worker batch size (dashed: speed change, dotted: controller change;\n"
                               "median of 3 pushes: hides the short last batch of an epoch)", step=True),
        aspplots.cycle_compute(run_dir / "cycle_compute.png", data, data.series("cycle_s", 1e3, WINDOW),
                               data.series("compute_s", 1e3, WINDOW)),
        aspplots.update_rate(run_dir / "update_rate.png", data, centres, rates),
        plots.loss_accuracy(run_dir / "loss_accuracy.png", data.loss[0], data.loss[1],
                            [t for t, _ in data.evals], [a for _, a in data.evals], xlabel="training time (s)",
                            loss_label=f"train loss (rolling median of {WINDOW} pushes per worker)"),
        aspplots.staleness(run_dir / "staleness.png", data.histogram,
                           [f"worker {w} ({m})" for w, m in enumerate(means)], "Staleness per worker"),
    ]


def render_asp_bench(bench_dir: Path) -> list[Path]:
    bench_dir = Path(bench_dir)
    settings, results = load_bench(bench_dir)
    budget_s = float(json.loads((bench_dir / "bench.json").read_text(encoding="utf-8")).get("time_budget_s") or 0)
    arms = [a for a in ARM_ORDER if any(r["arm"] == a for r in results)]
    arms += [a for a in dict.fromkeys(str(r["arm"]) for r in results) if a not in arms]
    rows = {(str(r["setting"]), str(r["arm"])): r for r in results}
    values, ranges = {}, {}
    for key, r in rows.items():
        acc = r.get("accuracy_at_budget") or {}
        if isinstance(acc.get("mean"), (int, float)):
            values[key] = acc["mean"] * 100
            ranges[key] = (acc.get("min", acc["mean"]) * 100, acc.get("max", acc["mean"]) * 100)
    out = []
    if values:
        out.append(aspplots.bench_accuracy(bench_dir / "accuracy.png", settings, arms, values, ranges, budget_s))
    for s in settings:
        curves = {a: rows[s, a]["accuracy_curves"] for a in arms if rows.get((s, a), {}).get("accuracy_curves")}
        if curves:
            out.append(aspplots.accuracy_curves(bench_dir / f"accuracy-{s}.png", s, curves, budget_s))
        hists = {a: rows[s, a]["staleness_histogram"] for a in arms if rows.get((s, a), {}).get("staleness_histogram")}
        if hists:
            out.append(aspplots.staleness_panels(bench_dir / f"staleness-{s}.png", s, hists))
    return out


def write_asp_tensorboard(run_dir: Path, logdir: Path) -> None:
    """Per-push scalars (by server version) and test accuracy of an ASP run, for TensorBoard."""
    data = load_asp_run(Path(run_dir))
    from omnilearn.experiments.report.runs import summary_writer

    writer = summary_writer(logdir)
    try:
        for rank, ps in data.pushes.items():
            for p in ps:
                for field, tag, scale in (("batch", "batch", 1.0), ("cycle_s", "cycle_ms", 1e3),
                                          ("compute_s", "compute_ms", 1e3), ("staleness", "staleness", 1.0)):
                    writer.add_scalar(f"worker{rank}/{tag}", float(p[field]) * scale, int(p["version"]))
        for p in sorted((p for ps in data.pushes.values() for p in ps), key=lambda p: p["version"]):
            if isinstance(p.get("loss"), (int, float)):
                writer.add_scalar("train/loss", float(p["loss"]), int(p["version"]))
        for e in _read_jsonl(Path(run_dir) / "metrics.jsonl"):
            if e.get("event") == "eval" and isinstance(e.get("test_accuracy"), (int, float)):
                writer.add_scalar("test/accuracy", e["test_accuracy"], int(e.get("version", 0)))
    finally:
        writer.close()
