"""Unit tests for the plots of runs and benches (``omnilearn.experiments.report``: records, runs, plots, asp...).

Synthetic ``metrics.jsonl`` / ``summary.json`` / ``bench.json`` files are built
in ``tmp_path``; the rendered files must be real PNGs. The pure helpers
(rolling median, per-step T*, batch-weighted loss, training time) are checked
on hand-computed values, and unusable directories raise ``ReportError``
naming the path. ASP runs (``push`` events) and ``bench --mode asp``
directories get their own PNGs (``omnilearn.experiments.report.asp``).
A last line cut by a crash is skipped with one warning, a bad line elsewhere
is an error; a resumed run (``resume`` events) reads as one run, each step
once: ``replay`` by hand on both modes, and against a simulated run crashed
and resumed at random points (hypothesis).

Run:  cd /work/main && python -m pytest -q tests/unit/test_report.py
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from omnilearn.balance.efficiency import StepRow
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.experiments.report.records import (
    ReportError, load_run, replay, rolling_median, step_ideal_s, training_time_s, weighted_loss,
)
from omnilearn.experiments.report.runs import render, render_bench, render_run, write_tensorboard

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RUN_PNGS = ["batches.png", "compute_wait.png", "step_time.png", "loss_accuracy.png"]


def step_record(step, rank, batch, speed, wait_s, loss):
    compute_s = 0.002 + batch / speed
    return {"event": "step", "step": step, "epoch": step // 10, "rank": rank, "batch": batch, "compute_s": compute_s,
            "wait_s": wait_s, "step_s": compute_s + wait_s, "loss": loss, "lr": 0.05, "delay_s": 0.0}


def synthetic_run(run_dir, n_steps=30, speeds=(4000.0, 2000.0, 1000.0), evals=True, summary=True):
    """Workers at the given speeds, uniform batches until a rebalance at step 15, a speed change at step 20."""
    n, batch = len(speeds), [512 // len(speeds)] * len(speeds)
    batch[0] += 512 - sum(batch)
    records = [{"event": "speeds", "step": 0, "speeds": list(speeds)}]
    for step in range(n_steps):
        if step == 15 and n > 1:
            records.append({"event": "decision", "step": 14, "effective_step": 15, "old": batch,
                            "new": [256, 171, 85][:n], "times_s": [0.03] * n, "changed": True})
            batch = [256, 171, 85][:n]
        if step == 20:
            speeds = speeds[::-1]
            records.append({"event": "speeds", "step": 20, "speeds": list(speeds)})
        times = [0.002 + b / v for b, v in zip(batch, speeds)]
        for rank in range(n):
            records.append(step_record(step, rank, batch[rank], speeds[rank], max(times) - times[rank] + 0.001,
                                       2.3 - 0.02 * step + 0.01 * rank))
        if evals and step in (14, n_steps - 1):
            records.append({"event": "eval", "epoch": step // 10, "step": step + 1, "wall_s": 0.03 * step,
                            "test_loss": 2.0, "test_accuracy": 0.2 + 0.01 * step})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({"balance_efficiency": 0.87, "steps": n_steps}))
    return run_dir


def synthetic_bench(bench_dir):
    results = []
    for setting, ideal in (("HL1", 1.0), ("HL2", 1.15), ("HL8", 3.0)):
        for arm, speedup, eff in (("uniform", None, 0.5), ("static", 1.4, 0.7), ("omnilearn", 1.8, 0.9),
                                  ("ddp", 0.95, None)):
            results.append({"setting": setting, "arm": arm, "speedup": speedup if setting != "HL1" else 1.0,
                            "ideal_speedup": ideal, "balance_efficiency": eff, "mean_step_s": 0.04})
    results.append({"setting": "HL4", "arm": "omnilearn", "speedup": None, "ideal_speedup": None,
                    "balance_efficiency": None, "mean_step_s": 0.04})
    bench_dir.mkdir(parents=True, exist_ok=True)
    (bench_dir / "bench.json").write_text(json.dumps({"settings": ["HL1", "HL2", "HL4", "HL8"], "results": results}))
    return bench_dir


def assert_pngs(paths, directory, names):
    assert [p.name for p in paths] == names
    for p in paths:
        assert p.parent == directory and p.is_file()
        data = p.read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 10_000, f"{p.name} is suspiciously small ({len(data)} bytes)"


# ---------------------------------------------------------------- pure helpers

def test_rolling_median_hand_computed():
    assert rolling_median([1, 100, 2, 3, 4], window=3) == [50.5, 2, 3, 3, 3.5]
    assert rolling_median([5, 1, 9, 7, 3], window=5) == [5, 6, 5, 5, 7]
    assert rolling_median([], window=5) == []
    assert rolling_median([7.0], window=5) == [7.0]


def test_rolling_median_ignores_nan():
    out = rolling_median([math.nan, 4.0, math.nan, math.nan, math.nan], window=3)
    assert out[:3] == [4.0, 4.0, 4.0]
    assert math.isnan(out[3]) and math.isnan(out[4])


def test_step_ideal_hand_computed():
    # B = 300, speeds 200/0.1 = 2000 and 100/0.1 = 1000 samples/s -> 0.1 s, plus min wait 0.01 s
    rows = [StepRow(0, 0, 200, 0.1, 0.01, 0.11), StepRow(0, 1, 100, 0.1, 0.03, 0.13)]
    assert step_ideal_s(rows) == pytest.approx(0.11)
    # an imbalanced split: v = 1000 + 2000 -> 300/3000 = 0.1 s, plus min wait 0.0
    rows = [StepRow(0, 0, 100, 0.1, 0.1, 0.2), StepRow(0, 1, 200, 0.1, 0.0, 0.2)]
    assert step_ideal_s(rows) == pytest.approx(0.1)
    assert math.isnan(step_ideal_s([StepRow(0, 0, 10, 0.0, 0.0, 0.0)]))
    assert math.isnan(step_ideal_s([]))


def test_weighted_loss_and_training_time():
    assert weighted_loss([1.0, 4.0], [300, 100]) == pytest.approx((300 + 400) / 400)
    assert weighted_loss([2.0], [64]) == 2.0
    assert math.isnan(weighted_loss([], []))
    assert training_time_s([0.1, 0.2, math.nan, 0.3]) == pytest.approx([0.1, 0.3, 0.3, 0.6])


def test_load_run_series(tmp_path):
    data = load_run(synthetic_run(tmp_path / "run"))
    assert data.steps == list(range(30)) and data.ranks == [0, 1, 2]
    assert data.per_rank["batch"][2][14:16] == [170, 85]
    assert data.speed_changes == [(20, [1000.0, 2000.0, 4000.0])]  # step-0 speeds are not a change
    assert data.rebalances == [15]
    assert [e["step"] for e in data.evals] == [15, 30]
    # step 0: batches 172/170/170, losses 2.30/2.31/2.32
    assert data.loss_by_step[0] == pytest.approx((172 * 2.30 + 170 * 2.31 + 170 * 2.32) / 512)
    assert data.summary["balance_efficiency"] == 0.87


# ---------------------------------------------------------------- rendering

def test_render_run(tmp_path):
    run_dir = synthetic_run(tmp_path / "run")
    assert_pngs(render(run_dir), run_dir, RUN_PNGS)


@pytest.mark.parametrize("kwargs", [
    {"n_steps": 1, "evals": False, "summary": False},
    {"speeds": (1000.0,), "evals": False},
    {"n_steps": 2, "speeds": (3000.0, 1000.0)},
])
def test_render_run_edge_cases(tmp_path, kwargs):
    run_dir = synthetic_run(tmp_path / "run", **kwargs)
    assert_pngs(render_run(run_dir), run_dir, RUN_PNGS)


def test_render_bench(tmp_path):
    bench_dir = synthetic_bench(tmp_path / "bench")
    assert_pngs(render(bench_dir), bench_dir, ["speedup.png", "efficiency.png"])
    assert_pngs(render_bench(bench_dir), bench_dir, ["speedup.png", "efficiency.png"])


def test_render_bench_skips_empty_figures(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps({"results": [
        {"setting": "HL8", "arm": "omnilearn", "speedup": None, "ideal_speedup": None,
         "balance_efficiency": 0.9, "mean_step_s": 0.03}]}))
    assert [p.name for p in render_bench(tmp_path)] == ["efficiency.png"]


# ---------------------------------------------------------------- errors

def test_empty_directory_names_the_path(tmp_path):
    with pytest.raises(ReportError, match="holds neither metrics.jsonl .* nor bench.json") as e:
        render(tmp_path)
    assert str(tmp_path) in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_path(tmp_path):
    with pytest.raises(ReportError, match="does not exist") as e:
        render(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)


@pytest.mark.parametrize("content, match", [
    ('{"event": "step", "step": 0\n{"event": "eval"}\n', "line 1 is not JSON"),  # a bad line in the middle
    ('{"event": "step", "step": 0\n', "no step records"),  # the only line is cut: warned about, left out
    ('{"event": "eval", "epoch": 0, "step": 1, "test_accuracy": 0.5}\n', "no step records"),
    ('{"event": "step", "step": 0, "rank": 0}\n', "lacks one of"),
    ("", "no step records"),
])
def test_malformed_metrics(tmp_path, content, match):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ReportError, match=match) as e:
        render(tmp_path)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize("content", ["not json", '{"settings": ["HL1"]}', '{"results": []}', '{"results": [{}]}'])
def test_malformed_bench(tmp_path, content):
    (tmp_path / "bench.json").write_text(content)
    with pytest.raises(ReportError) as e:
        render(tmp_path)
    assert str(tmp_path / "bench.json") in str(e.value)


def test_tensorboard_missing_package(tmp_path, monkeypatch):
    run_dir = synthetic_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with pytest.raises(ReportError, match="pip install tensorboard"):
        write_tensorboard(run_dir, tmp_path / "tb")


# ---------------------------------------------------------------- ASP runs and benches

from omnilearn.experiments.report.asp import render_asp_bench  # noqa: E402
from omnilearn.experiments.report.aspruns import is_asp_run, load_asp_run, push_rates  # noqa: E402

ASP_PNGS = ["batches.png", "cycle_compute.png", "update_rate.png", "loss_accuracy.png", "staleness.png"]


def synthetic_asp_run(run_dir, pushes=120, summary=True, speeds=(1.0, 1.0, 4.0)):
    """Workers pushing at rates proportional to ``speeds``; a rebalance at version 60, a speed change at 90."""
    n = len(speeds)
    records = [{"event": "speeds", "version": 0, "step": 0, "speeds": list(speeds)},
               {"event": "eval", "epoch": -1, "version": 0, "step": 0, "wall_s": 0.0, "test_loss": 2.3,
                "test_accuracy": 0.1}]
    next_s = [1.0 / s for s in speeds]
    pulled = [0] * n
    for version in range(1, pushes + 1):
        w = min(range(n), key=lambda k: next_s[k])
        t = next_s[w]
        batch = 100 if version <= 60 else int(100 * speeds[w] * n / sum(speeds))
        records.append({"event": "push", "version": version, "rank": w, "batch": batch,
                        "staleness": version - 1 - pulled[w], "pulled_version": pulled[w], "cycle_s": 1.0 / speeds[w],
                        "compute_s": 0.8 / speeds[w], "loss": 2.3 - version / 100, "lr": 0.01, "wall_s": t,
                        "epoch": version / 40})
        pulled[w], next_s[w] = version, t + 1.0 / speeds[w]
        if version == 60:
            records.append({"event": "decision", "step": 60, "old": [100] * n, "new": [90, 90, 120],
                            "times_s": [1.0] * n,
                            "changed": True, "reason": "largest change 20%"})
        if version == 90:
            records.append({"event": "speeds", "version": 90, "step": 30, "speeds": [4.0, 1.0, 1.0]})
        if version % 40 == 0:
            records.append({"event": "eval", "epoch": version // 40 - 1, "version": version, "step": version // n,
                            "wall_s": t + 0.5, "test_loss": 2.0, "test_accuracy": 0.1 + version / 400})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({"mode": "asp", "updates": pushes}))
    return run_dir


def test_asp_run_is_detected_by_summary_or_push_events(tmp_path):
    assert is_asp_run(synthetic_asp_run(tmp_path / "a"))
    assert is_asp_run(synthetic_asp_run(tmp_path / "b", summary=False))  # interrupted: no summary.json yet
    assert not is_asp_run(synthetic_run(tmp_path / "bsp"))
    assert not is_asp_run(synthetic_run(tmp_path / "bsp-no-summary", summary=False))


def test_load_asp_run_places_events_on_the_training_time_axis(tmp_path):
    data = load_asp_run(synthetic_asp_run(tmp_path / "run"))
    assert data.ranks == [0, 1, 2]
    assert sum(len(ps) for ps in data.pushes.values()) == 120
    pushes = sorted((p for ps in data.pushes.values() for p in ps), key=lambda p: p["version"])
    assert data.rebalances == [pushes[59]["wall_s"]]  # the decision after version 60
    assert data.speed_changes == [(pushes[89]["wall_s"], [4.0, 1.0, 1.0])]  # the version-0 speeds are no change
    assert [a for _, a in data.evals] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert data.evals[1][0] == pushes[39]["wall_s"]  # not the eval's own wall_s (0.5 s later)
    assert [sum(row) for row in data.histogram] == [len(data.pushes[k]) for k in (0, 1, 2)]
    assert len(data.loss[0]) == len(data.loss[1]) == 120


def test_push_rates_hand_computed():
    centres, rates = push_rates({0: [0.5, 1.5, 1.6, 4.0], 1: [2.0]}, bins=2)  # slices [0, 2) and [2, 4]
    assert centres == [1.0, 3.0]
    assert rates == {0: [1.5, 0.5], 1: [0.0, 0.5]}  # 3 pushes / 2 s, then 1 / 2 s
    assert push_rates({0: [], 1: []}, bins=5) == ([0.5], {0: [0.0], 1: [0.0]})
    centres, _ = push_rates({0: [i / 10 for i in range(1, 101)]})
    assert len(centres) == 10  # about 10 pushes per worker and slice


def test_render_asp_run(tmp_path):
    run_dir = synthetic_asp_run(tmp_path / "run")
    assert_pngs(render(run_dir), run_dir, ASP_PNGS)


@pytest.mark.parametrize("kwargs", [{"pushes": 1}, {"pushes": 3, "summary": False}, {"speeds": (2.0,)}])
def test_render_asp_run_edge_cases(tmp_path, kwargs):
    run_dir = synthetic_asp_run(tmp_path / "run", **kwargs)
    paths = render(run_dir)
    assert [p.name for p in paths] == ASP_PNGS
    assert all(p.read_bytes()[:8] == PNG_SIGNATURE for p in paths)


def test_malformed_asp_push(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "push", "version": 1, "rank": 0}\n')
    with pytest.raises(ReportError, match="push record lacks one of") as e:
        render(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "summary.json").write_text('{"mode": "asp"}')
    (tmp_path / "metrics.jsonl").write_text('{"event": "eval", "version": 0, "test_accuracy": 0.1}\n')
    with pytest.raises(ReportError, match="no push records"):
        render(tmp_path)


def synthetic_asp_bench(bench_dir, settings=("HL4", "HL8")):
    results = []
    for s in settings:
        for arm, acc, hist in (("uniform", [0.5, 0.6], [[1, 5, 2], [0, 0, 9]]),
                               ("omnilearn", [0.7, 0.72], [[3, 4], [4, 3]]),
                               ("bsp", [0.74, 0.74], None)):
            results.append({"setting": s, "arm": arm, "levels": "bsp" if arm == "bsp" else "asp",
                            "accuracy_at_budget": {"mean": sum(acc) / 2, "min": min(acc), "max": max(acc),
                                                   "per_repeat": acc},
                            "accuracy_curves": [[[1.0, 0.2], [2.0, acc[0]]], [[1.1, 0.3], [2.0, acc[1]]]],
                            "staleness_histogram": hist})
    bench_dir.mkdir(parents=True, exist_ok=True)
    (bench_dir / "bench.json").write_text(json.dumps({"train_mode": "asp", "mode": "quick", "time_budget_s": 2.0,
                                                      "settings": list(settings), "results": results}))
    return bench_dir


def test_render_asp_bench(tmp_path):
    bench_dir = synthetic_asp_bench(tmp_path / "bench")
    names = ["accuracy.png", "accuracy-HL4.png", "staleness-HL4.png", "accuracy-HL8.png", "staleness-HL8.png"]
    assert_pngs(render(bench_dir), bench_dir, names)
    assert_pngs(render_asp_bench(bench_dir), bench_dir, names)


def test_asp_tensorboard_or_a_clear_message(tmp_path, monkeypatch):
    run_dir = synthetic_asp_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ReportError, match="pip install tensorboard"):
        write_tensorboard(run_dir, tmp_path / "tb")


# ---------------------------------------------------------------- cut lines and resumed runs

def write_records(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run_dir


def test_cut_last_line_is_skipped_with_one_warning(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "run")
    whole = (run_dir / "metrics.jsonl").read_text()
    n = len(whole.splitlines()) + 1
    (run_dir / "metrics.jsonl").write_text(whole + '{"event": "step", "step": 30, "rank": 0, "bat')
    assert load_run(run_dir).steps == list(range(30))
    assert_pngs(render(run_dir), run_dir, RUN_PNGS)  # reads it again: no second warning
    err = capsys.readouterr().err.strip()
    assert err == f"omnilearn: warning: {run_dir / 'metrics.jsonl'} line {n} is cut; using the {n - 1} lines before it"


def test_bad_line_in_the_middle_names_file_and_line(tmp_path):
    run_dir = synthetic_run(tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[5] = lines[5][:20]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl: line 6 is not JSON") as e:
        render(run_dir)
    assert str(run_dir) in str(e.value)


def test_cut_line_before_a_resume_is_skipped(tmp_path, capsys):
    records = [step_record(s, 0, 64, 1000.0, 0.001, 2.0) for s in range(4)]
    tail = '{"event": "step", "ste\n' + json.dumps({"event": "resume", "step": 2}) + "\n"
    tail += "".join(json.dumps(step_record(s, 0, 64, 1000.0, 0.001, 1.0)) + "\n" for s in range(2, 6))
    run_dir = write_records(tmp_path / "run", records, tail)
    data = load_run(run_dir)
    assert data.steps == list(range(6)) and data.per_rank["loss"][0] == [2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    assert "line 5 is cut (the run stopped there and was resumed); skipping it" in capsys.readouterr().err


def test_replay_bsp_by_hand():
    def step(s, attempt):
        return {"event": "step", "step": s, "rank": 0, "attempt": attempt}

    first = [{"event": "speeds", "step": 0, "speeds": [1, 2]}] + [step(s, 1) for s in range(10)]
    first += [{"event": "decision", "step": 4, "attempt": 1}, {"event": "decision", "step": 9, "attempt": 1},
              {"event": "eval", "step": 6, "attempt": 1}, {"event": "eval", "step": 10, "attempt": 1},
              {"event": "speeds", "step": 6, "speeds": [2, 1]}, {"event": "speeds", "step": 8, "speeds": [1, 1]},
              {"event": "note"}]
    second = [{"event": "resume", "step": 6}, {"event": "speeds", "step": 6, "speeds": [2, 1]}]
    second += [step(s, 2) for s in range(6, 12)] + [{"event": "decision", "step": 9, "attempt": 2}]
    kept = replay(first + second)
    assert [(r["step"], r["attempt"]) for r in kept if r["event"] == "step"] == (
        [(s, 1) for s in range(6)] + [(s, 2) for s in range(6, 12)])
    assert [(r["step"], r["attempt"]) for r in kept if r["event"] == "decision"] == [(4, 1), (9, 2)]
    assert [(r["step"], r["attempt"]) for r in kept if r["event"] == "eval"] == [(6, 1)]  # eval 6 was before step 6
    assert [r["step"] for r in kept if r["event"] == "speeds"] == [0, 6]  # at 6: written again, the new one kept
    assert kept.index(second[1]) > kept.index(second[0])
    assert sum(r["event"] in ("note", "resume") for r in kept) == 2
    again = replay(first + second + [{"event": "eval", "step": 6, "attempt": 2}])  # the resumed run redid eval 6
    assert [(r["step"], r["attempt"]) for r in again if r["event"] == "eval"] == [(6, 2)]


def test_replay_asp_by_hand():
    def push(v, attempt):
        return {"event": "push", "version": v, "rank": v % 2, "attempt": attempt}

    first = [{"event": "eval", "version": 0, "step": 0}] + [push(v, 1) for v in range(1, 21)]
    first += [{"event": "decision", "step": 10}, {"event": "decision", "step": 20},
              {"event": "eval", "version": 12, "step": 6}, {"event": "speeds", "version": 15, "step": 7}]
    second = [{"event": "resume", "version": 12, "step": 6}] + [push(v, 2) for v in range(13, 26)]
    kept = replay(first + second)
    assert [(r["version"], r["attempt"]) for r in kept if r["event"] == "push"] == (
        [(v, 1) for v in range(1, 13)] + [(v, 2) for v in range(13, 26)])
    assert [r["step"] for r in kept if r["event"] == "decision"] == [10]
    assert [r["version"] for r in kept if r["event"] == "eval"] == [0, 12]
    assert not [r for r in kept if r["event"] == "speeds"]
    again = replay(first + second + [{"event": "eval", "version": 12, "step": 6, "attempt": 2}])
    assert [r.get("attempt") for r in again if r["event"] == "eval"] == [None, 2]


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 40), crashes=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=4))
def test_replay_of_a_crashed_and_resumed_run_is_the_run_once(total, crashes):
    """Each attempt resumes at a checkpoint no later than where the last one got, and runs until it crashes."""
    records, done = [], 0
    for attempt, (checkpoint, crash) in enumerate([*crashes, (total, total)]):
        start = min(checkpoint, done)
        if attempt:
            records.append({"event": "resume", "step": start})
        end = total if attempt == len(crashes) else min(total, start + crash)
        for s in range(start, end):
            records += [{"event": "step", "step": s, "rank": k, "attempt": attempt} for k in range(2)]
            records.append({"event": "eval", "step": s + 1, "attempt": attempt})
        done = end
    kept = replay(records)
    steps = [(r["step"], r["rank"]) for r in kept if r["event"] == "step"]
    assert sorted(steps) == [(s, k) for s in range(total) for k in range(2)]  # every step once
    assert [r["step"] for r in kept if r["event"] == "eval"] == list(range(1, total + 1))
    last = {}
    for r in records:
        if r["event"] == "step":
            last[r["step"]] = r["attempt"]
    assert all(r["attempt"] == last[r["step"]] for r in kept if r["event"] == "step")  # the redone one


def test_report_of_a_resumed_run_plots_the_whole_run_once(tmp_path):
    whole = synthetic_run(tmp_path / "whole")
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    before = [r for r in records if r.get("step", 0) < 20 and not (r["event"] == "eval" and r["step"] > 20)]
    after = [r for r in records if r.get("step", 0) >= 15 and not (r["event"] == "eval" and r["step"] <= 15)]
    resumed = write_records(tmp_path / "resumed", before + [{"event": "resume", "step": 15}] + after)
    (resumed / "summary.json").write_text((whole / "summary.json").read_text())
    a, b = load_run(whole), load_run(resumed)
    assert b.steps == a.steps == list(range(30))
    assert [len(rs) for rs in b.rows_by_step] == [3] * 30
    assert (b.per_rank, b.loss_by_step, b.rebalances) == (a.per_rank, a.loss_by_step, a.rebalances)
    assert [e["step"] for e in b.evals] == [15, 30] and b.speed_changes == a.speed_changes
    assert_pngs(render(resumed), resumed, RUN_PNGS)


def test_asp_report_of_a_resumed_run_reads_each_push_once(tmp_path):
    whole = synthetic_asp_run(tmp_path / "whole")
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    crashed = [r for r in records if r.get("version", r.get("step", 0)) <= 100]
    redone = [r for r in records if r["event"] == "push" and r["version"] > 70]
    resumed = write_records(tmp_path / "resumed", crashed + [{"event": "resume", "version": 70}] + redone)
    data = load_asp_run(resumed)
    assert sorted(p["version"] for ps in data.pushes.values() for p in ps) == list(range(1, 121))
    assert len(data.rebalances) == 1  # the decision at version 60 was before the checkpoint
    assert [p.name for p in render(resumed)] == ASP_PNGS
