"""Matplotlib drawing for ``omnilearn.experiments.report.runs``: one function per PNG, Agg backend, no data reading.

Each function takes ready-made series, saves one figure (dpi 110), closes it
and returns the path (ASP runs and benches: :mod:`omnilearn.experiments.report.aspplots`). Use
it through ``omnilearn.experiments.report.runs.render``:

    omnilearn report runs/demo

Tests:  python -m pytest -q tests/unit/test_report.py
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from omnilearn.experiments.report.records import WINDOW, RunData  # noqa: E402

DPI = 110
SIZE = (9, 5)
ARM_COLORS = {"uniform": "tab:gray", "static": "tab:orange", "omnilearn": "tab:blue", "ddp": "tab:green",
              "model": "tab:purple"}
# Event marks stay out of the workers' palette (C0..C9): black dashed for a speed change, grey dotted for an
# applied controller change.
SPEED_MARK = {"color": "black", "linestyle": "--", "linewidth": 1.2}
CONTROLLER_MARK = {"color": "0.45", "linestyle": ":", "linewidth": 1.5}


def save_figure(fig, path: Path) -> Path:
    """Lay out, save (dpi 110) and close ``fig``; return ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def point_marker(n: int) -> str | None:
    """Points for series too short to show as a line."""
    return "o" if n < 3 else None


def relative_speed(speed: float, fastest: float) -> str:
    """``speed`` as a fraction of the fastest worker's: ``1``, ``1/3``, ``3/16``, or ``0.37`` when no short one fits."""
    ratio = speed / fastest
    short = Fraction(ratio).limit_denominator(16)
    return str(short) if abs(float(short) - ratio) < 1e-6 else f"{ratio:.2f}"


def _speed_text(speeds: Sequence[float]) -> str:
    return "speeds " + ", ".join(relative_speed(s, max(speeds)) for s in speeds)


def start_speeds(summary: dict[str, Any] | None) -> list[float] | None:
    """The declared speeds at step 0 from ``summary.json`` (its first speed change, else its declared speeds)."""
    summary = summary or {}
    changes = summary.get("speed_changes")
    if isinstance(changes, list) and changes and isinstance(changes[0], dict) and changes[0].get("step", 0) == 0:
        speeds = changes[0].get("speeds")
    else:
        speeds = summary.get("declared_speeds")
    ok = isinstance(speeds, list) and speeds and all(isinstance(v, (int, float)) and v > 0 for v in speeds)
    return [float(v) for v in speeds] if ok else None


def worker_label(name: str, index: int, speeds: Sequence[float] | None, changed: bool) -> str:
    """``rank 1 (speed 1/3)``: a worker's legend entry with its declared speed relative to the fastest."""
    if not speeds or not 0 <= index < len(speeds):
        return name
    return f"{name} (speed {relative_speed(speeds[index], max(speeds))}{' at start' if changed else ''})"


def rank_labels(data: RunData) -> dict[int, str]:
    """Legend entries of a BSP run's ranks, with their declared speeds at step 0 where the summary has them."""
    speeds = start_speeds(data.summary)
    return {r: worker_label(f"rank {r}", r, speeds, bool(data.speed_changes)) for r in data.ranks}


def mark_events(ax, data: RunData, annotate: bool = True) -> None:
    """Black dashed lines at speed changes (annotated with the new relative speeds), grey dotted at applied
    controller changes: neutral marks, none of the workers' colours, each with one legend entry."""
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for k, (step, speeds) in enumerate(data.speed_changes):
        ax.axvline(step, **SPEED_MARK, label="speed change" if k == 0 else None)
        if annotate:
            ax.annotate(_speed_text(speeds), xy=(step, 0.98), xycoords=top, xytext=(3, 0), textcoords="offset points",
                        rotation=90, va="top", ha="left", fontsize=8,
                        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    for k, step in enumerate(data.rebalances):
        ax.axvline(step, **CONTROLLER_MARK, label="controller change applied" if k == 0 else None)


def _marks_note(data: RunData) -> str:
    marks = (["dashed: speed change"] if data.speed_changes else []) + \
        (["dotted: controller change applied"] if data.rebalances else [])
    return f" ({', '.join(marks)})" if marks else ""


def batches(path: Path, data: RunData) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    m = point_marker(len(data.steps))
    labels = rank_labels(data)
    wider = min(1.1, 3.5 / max(1, len(data.ranks) - 1))  # earlier ranks drawn wider: equal batches stay visible
    for k, rank in enumerate(data.ranks):
        ax.step(data.steps, data.per_rank["batch"][rank], where="post", marker=m, color=f"C{rank % 10}",
                linewidth=1.5 + wider * (len(data.ranks) - 1 - k), label=labels[rank])
    mark_events(ax, data)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("local batch (samples)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    ax.set_title(f"Per-worker batch size{_marks_note(data)}\nspeed: declared, relative to the fastest worker")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def compute_wait(path: Path, data: RunData, smooth: Callable[[Sequence[float]], list[float]]) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    m = point_marker(len(data.steps))
    labels = rank_labels(data)
    for rank in data.ranks:
        color = f"C{rank % 10}"
        for ax, field in ((top, "compute_s"), (bottom, "wait_s")):
            ms = [v * 1e3 for v in data.per_rank[field][rank]]
            ax.plot(data.steps, smooth(ms), color=color, marker=m, linewidth=1.6, label=labels[rank])
    for ax, what in ((top, "compute"), (bottom, "wait (sync)")):
        mark_events(ax, data, annotate=ax is top)
        ax.set_ylabel(f"{what} (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    bottom.set_xlabel("step")
    top.set_title(f"Per-worker compute and wait time per step (rolling median of {WINDOW} steps)")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return save_figure(fig, path)


def step_time(path: Path, data: RunData, measured_ms: Sequence[float], ideal_ms: Sequence[float],
              efficiency: float | None) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    m = point_marker(len(data.steps))
    ax.plot(data.steps, measured_ms, color="tab:blue", marker=m, linewidth=1.8, label="measured (mean of workers)")
    ax.plot(data.steps, ideal_ms, color="tab:green", marker=m, linewidth=1.8, linestyle="-.",
            label="ideal T* = B/Σv + min wait")
    mark_events(ax, data)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    title = f"Step time: measured vs ideal (rolling median of {WINDOW} steps)"
    if isinstance(efficiency, (int, float)):
        title += f"\nbalance efficiency η = {efficiency:.3f} over the last half (summary.json)"
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def loss_accuracy(path: Path, time_s: Sequence[float], loss: Sequence[float], eval_s: Sequence[float],
                  accuracy: Sequence[float | None], xlabel: str = "training time (s, sum of step times)",
                  loss_label: str = "train loss (batch-weighted over workers)") -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    line = ax.plot(time_s, loss, color="tab:blue", marker=point_marker(len(time_s)), linewidth=1.5, label=loss_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("train loss (cross-entropy)")
    ax.grid(alpha=0.3)
    handles = list(line)
    points = [(t, a * 100) for t, a in zip(eval_s, accuracy) if isinstance(a, (int, float))]
    if points:
        acc = ax.twinx()
        xs, ys = zip(*points)
        handles += acc.plot(xs, ys, color="tab:orange", marker="o", linewidth=1.5, label="test accuracy")
        acc.set_ylabel("test accuracy (%)")
        acc.set_ylim(0, 100)
    ax.set_title("Training loss and test accuracy over training time")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=9, frameon=False)
    return save_figure(fig, path)


def _grouped(ax, settings: list[str], arms: list[str], values: dict, fmt: str, ranges: dict | None = None) -> float:
    """Grouped bars (one group per setting, one bar per arm), min–max whiskers from ``ranges[(setting, arm)]``
    where given (repeats); missing values are skipped. Returns bar width."""
    width = 0.8 / max(1, len(arms))
    ranges = ranges or {}
    for j, arm in enumerate(arms):
        shown = [(i, s) for i, s in enumerate(settings) if values[s, arm] is not None]
        xs = [i + (j - (len(arms) - 1) / 2) * width for i, _ in shown]
        ys = [values[s, arm] for _, s in shown]
        if xs:
            bars = ax.bar(xs, ys, width, color=ARM_COLORS.get(arm, f"C{(j + 4) % 10}"), label=arm)
            ax.bar_label(bars, fmt=fmt, fontsize=7, padding=1)
            spans = [ranges.get((s, arm)) for _, s in shown]
            if any(spans):
                spans = [span or (y, y) for y, span in zip(ys, spans)]
                err = [[y - lo for y, (lo, _) in zip(ys, spans)], [hi - y for y, (_, hi) in zip(ys, spans)]]
                ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor="black", elinewidth=1, capsize=2)
        for i, s in enumerate(settings):
            if values[s, arm] is None:
                ax.text(i + (j - (len(arms) - 1) / 2) * width, 0, "n/a", ha="center", va="bottom", fontsize=7,
                        rotation=90, color="dimgray")
    ax.set_xticks(range(len(settings)), settings)
    ax.set_xlabel("setting (heterogeneity level)")
    ax.grid(axis="y", alpha=0.3)
    return width


def _top(values: dict, ranges: dict | None, *more: float | None) -> float:
    highs = [v for v in values.values() if v is not None] + [hi for _, hi in (ranges or {}).values()]
    return max(highs + [v for v in more if v is not None])


def speedup(path: Path, settings: list[str], arms: list[str], values: dict, ideal: dict,
            ranges: dict | None = None) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    _grouped(ax, settings, arms, values, "%.2f", ranges)
    ax.axhline(1.0, color="black", linewidth=0.8)
    first = True
    for i, s in enumerate(settings):
        if ideal.get(s) is not None:
            ax.hlines(ideal[s], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.5,
                      label="ideal: uniform step / T*" if first else None)
            first = False
    ax.set_ylim(0, _top(values, ranges, *ideal.values()) * 1.15)
    ax.set_ylabel("speed-up over uniform batches (×)")
    whiskers = "\npaired per repeat; whiskers: min–max over repeats" if ranges else ""
    ax.set_title(f"Speed-up over uniform batches per setting (uniform = 1.0){whiskers}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return save_figure(fig, path)


def efficiency(path: Path, settings: list[str], arms: list[str], values: dict, ranges: dict | None = None) -> Path:
    fig, ax = plt.subplots(figsize=SIZE)
    _grouped(ax, settings, arms, values, "%.2f", ranges)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ideal (η = 1)")
    ax.set_ylim(0, _top(values, ranges, 1.0) * 1.12)
    ax.set_ylabel("balance efficiency η = T* / T measured")
    ax.set_title("Balance efficiency per setting and arm" + ("\nwhiskers: min–max over repeats" if ranges else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return save_figure(fig, path)
