"""Across the arms and repeats of ``omnilearn bench``: paired speed-ups, spread, verdicts and the table. Pure.

Input: one row per setting x arm x repeat (:func:`omnilearn.experiments.bench.bsp.measure`).

- :func:`add_paired` fills, per repeat, ``speedup`` (uniform step / the arm's,
  both of that repeat: paired), ``ideal_speedup`` (uniform in-step time / the
  lowest ``T*`` of the repeat's balanced arms), ``speedup_of_ideal`` and, for
  balanced arms (not ``uniform``, ``static``, ``ddp``), the paired ratios
  ``vs_uniform`` and ``vs_static`` (the other arm's step / this arm's).
- :func:`merge` makes one row per setting x arm: each figure's mean, and in
  ``spread[figure]`` its min, max and per-repeat values; a ``verdict`` per
  paired ratio (:func:`verdict`); for ``paper``, whether each speed change
  settled within one control interval in every repeat.
- :func:`add_floor`: a balanced arm's balance efficiency at HL1, beside each
  setting's (sync cost on the host caps it).
- :func:`markdown_table`: figures as ``mean (min–max)``, then the notes.

Test: ``pytest tests/unit/test_benchstats.py``.
"""

from __future__ import annotations

import math
from statistics import fmean, stdev
from typing import Sequence

FIXED_ARMS = ("uniform", "static", "ddp")  # every other arm is a balancing controller
FIGURES = ("mean_step_s", "samples_per_s", "in_step_s", "ideal_step_s", "balance_efficiency", "speedup",
           "ideal_speedup", "speedup_of_ideal", "run_step_s", "test_accuracy", "time_to_accuracy_s", "fidelity_error")
PER_WORKER = ("mean_batch", "compute_s_per_worker", "wait_s_per_worker")
RATIOS = ("vs_uniform", "vs_static")
SAME = "same (within spread)"
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def is_balanced(arm: str) -> bool:
    return arm not in FIXED_ARMS


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def add_paired(rows: list[dict]) -> None:
    """Paired speed-ups and ratios per repeat, in place (rows without ``repeat`` count as repeat 0)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r.get("repeat", 0)), []).append(r)
    for group in groups.values():
        by = {r["arm"]: r for r in group}
        base, static = by.get("uniform", {}), by.get("static", {})
        ideals = [r.get("ideal_step_s") for r in group if is_balanced(r["arm"]) and r.get("ideal_step_s")]
        ideal = _ratio(base.get("in_step_s"), min(ideals)) if ideals else None
        for r in group:
            r["speedup"] = _ratio(base.get("mean_step_s"), r["mean_step_s"])
            r["ideal_speedup"] = ideal
            r["speedup_of_ideal"] = _ratio(r["speedup"], ideal)
            if is_balanced(r["arm"]):
                r["vs_uniform"] = r["speedup"]
                r["vs_static"] = _ratio(static.get("mean_step_s"), r["mean_step_s"])


def ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """Student-t 95% confidence interval of the mean; ``None`` below 2 values."""
    n = len(values)
    if n < 2:
        return None
    half = (T_975[n - 2] if n - 2 < len(T_975) else 1.96) * stdev(values) / math.sqrt(n)
    return fmean(values) - half, fmean(values) + half


def verdict(ratios: Sequence[float | None]) -> str:
    """``faster`` when every repeat's paired ratio (other arm's time / this one's) is above 1, or the 95% CI of
    their geometric mean is (a t-interval of the log-ratios, so ``r`` and ``1/r`` get mirror verdicts);
    ``slower`` likewise below 1; else :data:`SAME`. Fewer than 2 repeats: no verdict."""
    if len(ratios) < 2 or any(r is None or r <= 0 for r in ratios):
        return f"– ({len(ratios)} repeat{'s' if len(ratios) != 1 else ''})"
    lo, hi = ci95([math.log(r) for r in ratios])
    if min(ratios) > 1 or lo > 0:
        return "faster"
    if max(ratios) < 1 or hi < 0:
        return "slower"
    return SAME


def spread_of(values: Sequence) -> dict:
    """Mean, min, max and the per-repeat values (mean/min/max ``None`` when a repeat has none)."""
    ok = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    whole = len(ok) == len(values) and ok
    return {"mean": fmean(ok) if whole else None, "min": min(ok) if whole else None,
            "max": max(ok) if whole else None, "per_repeat": list(values)}


def _worst(values: list) -> list | None:
    """Reaction/settle steps: element-wise the slowest repeat (``None``: some repeat never got there)."""
    if any(v is None for v in values) or len({len(v) for v in values}) != 1:
        return None
    return [None if any(x is None for x in col) else max(col) for col in zip(*values)]


def settled_within(per_repeat: list, interval: int) -> list[bool] | None:
    """Per speed change: settled within ``interval`` steps in every repeat."""
    if not per_repeat or any(v is None for v in per_repeat) or len({len(v) for v in per_repeat}) != 1:
        return None
    return [all(x is not None and x <= interval for x in col) for col in zip(*per_repeat)]


def merge(rows: list[dict], control_interval: int) -> list[dict]:
    """One row per setting x arm (first-seen order): figure means, ``spread``, verdicts, settling."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r["arm"]), []).append(r)
    out = []
    for (setting, arm), rs in groups.items():
        rs = sorted(rs, key=lambda r: r.get("repeat", 0))
        row = {"setting": setting, "arm": arm, "steps": rs[0]["steps"], "repeats": len(rs),
               "figures_from_step": rs[0].get("figures_from_step"), "step_clock": rs[0].get("step_clock"),
               "run_dirs": [r["run_dir"] for r in rs], "spread": {}}
        for key in FIGURES:
            row["spread"][key] = spread_of([r.get(key) for r in rs])
            row[key] = row["spread"][key]["mean"]
        for key in PER_WORKER:
            lists = [r.get(key) for r in rs]
            row[key] = None if any(v is None for v in lists) else [fmean(c) for c in zip(*lists)]
        if is_balanced(arm):
            row["verdict"] = {k: {"verdict": verdict([r.get(k) for r in rs]), **spread_of([r.get(k) for r in rs])}
                              for k in RATIOS}
        for key in ("reaction_steps", "settle_steps"):
            row[key] = _worst([r.get(key) for r in rs])
            row[f"{key}_per_repeat"] = [r.get(key) for r in rs]
        row["speed_change_steps"] = rs[0].get("speed_change_steps")
        row["settled_within_interval"] = (settled_within(row["settle_steps_per_repeat"], control_interval)
                                          if row["speed_change_steps"] is not None else None)
        out.append(row)
    return out


def add_floor(rows: list[dict], floor_setting: str = "HL1") -> None:
    """``efficiency_floor``: the same balanced arm's balance efficiency at HL1; ``efficiency_over_floor`` the ratio."""
    floor = {r["arm"]: r.get("balance_efficiency") for r in rows if r["setting"] == floor_setting}
    for r in rows:
        f = floor.get(r["arm"]) if is_balanced(r["arm"]) else None
        r["efficiency_floor"] = f
        r["efficiency_over_floor"] = _ratio(r.get("balance_efficiency"), f)


# ---------------------------------------------------------------- the table

def fmt_spread(s: dict | None, spec: str, scale: float = 1.0) -> str:
    """``mean (min–max)``; just the mean when all repeats agree (or there is one); ``–`` without a value."""
    if not s or s.get("mean") is None:
        return "–"
    mean, lo, hi = (format(s[k] * scale, spec) for k in ("mean", "min", "max"))
    return mean if lo == hi else f"{mean} ({lo}–{hi})"


def _steps(values: Sequence[int | None] | None) -> str:
    return "–" if values is None else ",".join("never" if x is None else str(x) for x in values)


def _verdict(r: dict, key: str) -> str:
    v = (r.get("verdict") or {}).get(key)
    if not v or v.get("mean") is None:
        return "–"
    return f"{v['verdict']} ×{fmt_spread(v, '.2f')}"


def _efficiency(r: dict) -> str:
    text = fmt_spread(r["spread"].get("balance_efficiency"), ".3f")
    if r.get("efficiency_floor") is None or r["setting"] == "HL1":
        return text
    return f"{text} / {r['efficiency_floor']:.3f}"


HEADER = ("| setting | arm | step ms | samples/s | speed-up | ideal speed-up | of ideal | balance eff. / HL1 floor | "
          "vs uniform | vs static | mean wait ms per worker | reaction steps (to T*+10%) | settle steps |")


def markdown_table(rows: Sequence[dict], control_interval: int | None = None) -> str:
    """The bench table (rows from :func:`merge`), then what the columns mean and the settling summary."""
    lines = [HEADER, "|" + "---|" * 13]
    for r in rows:
        sp = r.get("spread") or {}
        wait = "/".join(f"{w * 1e3:.1f}" for w in r.get("wait_s_per_worker") or []) or "–"
        lines.append(
            f"| {r['setting']} | {r['arm']} | {fmt_spread(sp.get('mean_step_s'), '.1f', 1e3)} | "
            f"{fmt_spread(sp.get('samples_per_s'), '.0f')} | {fmt_spread(sp.get('speedup'), '.2f')} | "
            f"{fmt_spread(sp.get('ideal_speedup'), '.2f')} | {fmt_spread(sp.get('speedup_of_ideal'), '.2f')} | "
            f"{_efficiency(r)} | {_verdict(r, 'vs_uniform')} | {_verdict(r, 'vs_static')} | {wait} | "
            f"{_steps(r.get('reaction_steps'))} | {_steps(r.get('settle_steps'))} |")
    repeats = max((r.get("repeats", 1) for r in rows), default=1)
    lines.append(f"\nMean over {repeats} repeat{'s' if repeats != 1 else ''} (min–max), each figure over the same "
                 "steady steps (from the first epoch boundary at half the run; paper: the whole run), after an "
                 "unmeasured warm-up job. Speed-up: per repeat against that repeat's uniform arm. Of ideal: speed-up "
                 "/ ideal speed-up. vs uniform / vs static: the other arm's step time / this arm's per repeat; "
                 "faster/slower only when every repeat (or the 95% CI) is on one side of 1. HL1 floor: the arm's "
                 "balance efficiency at HL1, where there is nothing to balance.")
    lines += settle_lines(rows, control_interval)
    return "\n".join(lines)


def settle_lines(rows: Sequence[dict], control_interval: int | None) -> list[str]:
    """One line per balanced arm of a dynamic routine: how many speed changes settled within one interval."""
    out = []
    for r in rows:
        ok = r.get("settled_within_interval")
        if ok is None or not is_balanced(r["arm"]):
            continue
        per = ",".join("yes" if x else "no" for x in ok)
        out.append(f"{r['setting']}, {r['arm']}: settled within one control interval ({control_interval} steps) "
                   f"after {sum(ok)} of {len(ok)} speed changes in every repeat ({per}; worst repeat's settle "
                   f"steps {_steps(r.get('settle_steps'))})")
    return out
