"""Matplotlib drawing of ASP runs and ``bench --mode asp`` for ``omnilearn.experiments.report.asp``: one function per PNG.

Like :mod:`omnilearn.experiments.report.plots` (whose style, colours and event marks it shares):
ready-made series in, one figure saved (Agg, dpi 110) and closed, its path out.

    omnilearn report runs/asp-demo

Tests:  python -m pytest -q tests/unit/test_report.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omnilearn.experiments.report.aspruns import AspRunData, Series
from omnilearn.experiments.report.plots import (ARM_COLORS, SIZE, mark_events, plt, point_marker, save_figure,
                                                start_speeds, worker_label)
from omnilearn.experiments.report.records import WINDOW

COLORS = {**ARM_COLORS, "bsp": "tab:green"}


def _legend(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)


def _labels(data: AspRunData) -> dict[int, str]:
    """``worker 1 (speed 1/7)``: each worker with its declared speed at the start, relative to the fastest."""
    speeds = start_speeds(data.summary)
    return {r: worker_label(f"worker {r}", r, speeds, bool(data.speed_changes)) for r in data.ranks}


def worker_series(path: Path, data: AspRunData, series: Series, ylabel: str, title: str, step: bool = False) -> Path:
    """One line per worker over training time (``step``: held until the next value, e.g. batch sizes)."""
    fig, ax = plt.subplots(figsize=SIZE)
    labels = _labels(data)
    for rank, (xs, ys) in sorted(series.items()):
        draw = ax.step if step else ax.plot
        kwargs = {"where": "post"} if step else {}
        draw(xs, ys, color=f"C{rank % 10}", marker=point_marker(len(xs)), linewidth=1.6,
             label=labels.get(rank, f"worker {rank}"), **kwargs)
    mark_events(ax, data)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(ax.get_ylim()[1], 1e-9) * 1.05)
    ax.set_title(title)
    _legend(ax)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def cycle_compute(path: Path, data: AspRunData, cycle_ms: Series, compute_ms: Series) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    labels = _labels(data)
    for ax, series, what in ((top, cycle_ms, "cycle: pull + compute + push"), (bottom, compute_ms, "compute")):
        for rank, (xs, ys) in sorted(series.items()):
            ax.plot(xs, ys, color=f"C{rank % 10}", marker=point_marker(len(xs)), linewidth=1.6,
                    label=labels.get(rank, f"worker {rank}"))
        mark_events(ax, data, annotate=ax is top)
        ax.set_ylabel(f"{what} (ms)", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    bottom.set_xlabel("training time (s)")
    top.set_title(f"Per-worker cycle and compute time per push (rolling median of {WINDOW} pushes)")
    _legend(top)
    return save_figure(fig, path)


def update_rate(path: Path, data: AspRunData, centres: Sequence[float], rates: dict[int, list[float]]) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    labels = _labels(data)
    for rank, ys in sorted(rates.items()):
        ax.plot(centres, ys, color=f"C{rank % 10}", marker=point_marker(len(centres)), linewidth=1.6,
                label=labels.get(rank, f"worker {rank}"))
    mark_events(ax, data)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("updates pushed per second")
    ax.set_ylim(bottom=0)
    ax.set_title("Per-worker push rate (balanced: equal rates, so equal staleness)")
    _legend(ax)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _hist_bars(ax, hist: Sequence[Sequence[int]], labels: Sequence[str]) -> None:
    """Grouped bars: per staleness value, one bar per worker, as a fraction of that worker's pushes."""
    n = max(1, len(hist))
    width = 0.8 / n
    for w, (counts, label) in enumerate(zip(hist, labels)):
        total = sum(counts) or 1
        xs = [s + (w - (n - 1) / 2) * width for s in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width, color=f"C{w % 10}", label=label)
    ax.set_xlabel("staleness (server updates since the worker pulled)")
    ax.set_ylabel("fraction of the worker's pushes")
    ax.grid(axis="y", alpha=0.3)


def staleness(path: Path, hist: Sequence[Sequence[int]], labels: Sequence[str], title: str) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    _hist_bars(ax, hist, labels)
    ax.set_title(title)
    _legend(ax)
    return save_figure(fig, path)


def bench_accuracy(path: Path, settings: list[str], arms: list[str], values: dict, ranges: dict,
                   budget_s: float) -> Path:
    """Grouped bars of accuracy at the budget (%) per setting and arm, whiskers from min to max over repeats."""
    fig, ax = plt.subplots(figsize=SIZE)
    width = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        cols = [(i + (j - (len(arms) - 1) / 2) * width, values[s, arm], ranges[s, arm])
                for i, s in enumerate(settings) if values.get((s, arm)) is not None]
        if not cols:
            continue
        xs, ys, rs = zip(*cols)
        bars = ax.bar(xs, ys, width, color=COLORS.get(arm, f"C{j + 4}"), label=arm)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        ax.errorbar(xs, ys, yerr=[[y - r[0] for y, r in zip(ys, rs)], [r[1] - y for y, r in zip(ys, rs)]],
                    fmt="none", ecolor="black", capsize=3, linewidth=1)
    ax.set_xticks(range(len(settings)), settings)
    ax.set_xlabel("setting (heterogeneity level; asp arms: ASP table, bsp: BSP table)")
    ax.set_ylabel("test accuracy at the budget (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Test accuracy after {budget_s:g} s of training (mean, whiskers: min–max over repeats)")
    ax.grid(axis="y", alpha=0.3)
    _legend(ax)
    return save_figure(fig, path)


def accuracy_curves(path: Path, setting: str, curves: dict[str, list[list[list[float]]]], budget_s: float) -> Path:
    """Test accuracy over training time, one colour per arm, one line per repeat."""
    fig, ax = plt.subplots(figsize=SIZE)
    for j, (arm, repeats) in enumerate(curves.items()):
        for k, points in enumerate(repeats):
            if points:
                xs, ys = zip(*((t, a * 100) for t, a in points))
                ax.plot(xs, ys, color=COLORS.get(arm, f"C{j + 4}"), marker="o", markersize=3, linewidth=1.4,
                        alpha=1.0 if k == 0 else 0.6, label=arm if k == 0 else None)
    ax.axvline(budget_s, color="black", linestyle="--", linewidth=1, label=f"budget {budget_s:g} s")
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{setting}: test accuracy over training time per arm (one line per repeat)")
    ax.grid(alpha=0.3)
    _legend(ax)
    return save_figure(fig, path)


def staleness_panels(path: Path, setting: str, hists: dict[str, list[list[int]]]) -> Path:
    """One panel per ASP arm: its staleness histogram per worker (repeats summed)."""
    fig, axes = plt.subplots(1, len(hists), figsize=(5 * len(hists) + 1, 4.5), sharey=True, squeeze=False)
    for ax, (arm, hist) in zip(axes[0], hists.items()):
        top = [max((s for s, c in enumerate(row) if c), default=0) for row in hist]
        _hist_bars(ax, hist, [f"worker {w} (max {m})" for w, m in enumerate(top)])
        ax.set_title(f"{setting} {arm}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("Staleness per worker and arm (fraction of each worker's pushes)")
    return save_figure(fig, path)
