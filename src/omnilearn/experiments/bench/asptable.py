"""The ``omnilearn bench --mode asp`` table (rows from :func:`omnilearn.experiments.bench.aspresults.merge`). Pure.

One line per setting x arm: training seconds, final accuracy, accuracy at the
budget (marked ``late: T s`` where some repeat had no evaluation by the budget
and its first one after it stands in: :func:`~omnilearn.experiments.bench.stats.accuracy_by_budget`),
at equal epochs, time to the target, staleness; then a footnote on what each column means.

Test: ``pytest tests/unit/test_benchstats.py``.
"""

from __future__ import annotations

from typing import Sequence

from omnilearn.experiments.bench.stats import SMOOTH_EVALS


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _pct(s: dict) -> str:
    if s["mean"] is None:
        return "–"
    return f"{s['mean'] * 100:.1f}" + (f" ({s['min'] * 100:.1f}–{s['max'] * 100:.1f})" if s["max"] > s["min"] else "")


def _late(r: dict, budget_s: float) -> str:
    """`` (late: T s)`` when some repeat's accuracy at the budget comes from an evaluation after it."""
    at_s = (r.get("accuracy_at_budget_s") or {}).get("max")
    return f" (late: {at_s:.1f} s)" if at_s is not None and at_s > budget_s else ""


def _epochs(values: Sequence[int | None] | None) -> str:
    done = sorted({v for v in values or [] if v is not None})
    return "" if not done else f" @{done[0]}" if len(done) == 1 else f" @{done[0]}–{done[-1]}"


def asp_markdown_table(results: Sequence[dict], budget_s: float, target: float | None) -> str:
    """The ``bench --mode asp`` table, with a footnote on what each column means."""
    goal = "target" if target is None else f"{target * 100:g}%"
    lines = [f"| setting | HL table | arm | train s | final test acc % | acc % at budget | acc % at equal epochs | "
             f"time to {goal} s | mean staleness | p99 staleness | max staleness | mean staleness per worker | "
             "p99 staleness per worker | updates/s per worker |",
             "|" + "---|" * 14]
    for r in results:
        tta = r.get("time_to_accuracy_s")
        tta_text = "–" if target is None else "never" if tta["mean"] is None else f"{tta['mean']:.1f}"
        rates = "/".join(f"{u:.1f}" for u in r.get("updates_per_s_per_worker") or []) or "–"
        stale = "/".join(f"{u:.1f}" for u in r.get("mean_staleness_per_worker") or []) or "–"
        p99 = "/".join(str(u) for u in r.get("p99_staleness_per_worker") or []) or "–"
        at_epochs = r.get("accuracy_at_equal_epochs") or {"mean": None}
        lines.append(
            f"| {r['setting']} | {r['levels']} | {r['arm']} | {r['train_s']['mean']:.1f} | "
            f"{_pct(r['test_accuracy'])} | {_pct(r['accuracy_at_budget'])}{_late(r, budget_s)} | "
            f"{_pct(at_epochs)}{_epochs(r.get('equal_epochs')) if at_epochs['mean'] is not None else ''} | "
            f"{tta_text} | {_fmt(r.get('mean_staleness'), '.2f')} | {_fmt(r.get('p99_staleness'), 'd')} | "
            f"{_fmt(r.get('max_staleness'), 'd')} | {stale} | {p99} | {rates} |")
    lines.append(f"\nBudget {budget_s:g} s of training per arm (evaluation excluded). Accuracy: mean over repeats "
                 f"(seeds; min–max); at budget: the mean of the last {SMOOTH_EVALS} evaluations at or before it "
                 "(late: T s where a repeat had none by then and its first evaluation, after T s of training, "
                 f"stands in); at equal epochs: of the last {SMOOTH_EVALS} up to the largest number of whole "
                 "epochs of data (@E) that every arm of the setting reached in that repeat (one evaluation moves "
                 "2-4 points). asp arms: the ASP HL table, bsp: the BSP table (synchronous: staleness 0, updates/s "
                 "= steps/s). Mean staleness over all pushes is about workers - 1 whatever the balance; per "
                 "worker, p99 and max show it (p99 and max: the worst repeat's).")
    return "\n".join(lines)
