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
arithmetic in :mod:`omnilearn.experiments.report.aspruns` (pure, tested);
drawing in :mod:`omnilearn.experiments.report.aspplots`.

Run:  omnilearn report runs/asp-demo   (or a bench --mode asp directory)
Tests:  python -m pytest -q tests/unit/test_report.py
"""

from __future__ import annotations

import json
from pathlib import Path

from omnilearn.experiments.report import aspplots, plots
from omnilearn.experiments.report.aspruns import load_asp_run, push_rates
from omnilearn.experiments.report.records import WINDOW, load_bench, read_jsonl, summary_writer

ARM_ORDER = ("uniform", "omnilearn", "bsp")


def render_asp_run(run_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    data = load_asp_run(run_dir)
    centres, rates = push_rates({k: [p["wall_s"] for p in ps] for k, ps in data.pushes.items()})
    means = [f"mean {sum(s * c for s, c in enumerate(h)) / max(1, sum(h)):.2f}, max "
             f"{max((s for s, c in enumerate(h) if c), default=0)}" for h in data.histogram]
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
        for e in read_jsonl(Path(run_dir) / "metrics.jsonl"):
            if e.get("event") == "eval" and isinstance(e.get("test_accuracy"), (int, float)):
                writer.add_scalar("test/accuracy", e["test_accuracy"], int(e.get("version", 0)))
    finally:
        writer.close()
