"""The run recorder streams and summarises in bounded memory, with the numbers the old all-rows code gave.

- :class:`SuffixStats` answers any suffix exactly (property test against brute force) holding at most one
  aggregate per chunk plus one open chunk.
- BSP ``Telemetry``: every row reaches its rank's ``steps/rank-<r>.jsonl``; the summary equals the old
  formulas of :mod:`omnilearn.balance.efficiency` over all rows kept in memory, both from every rank's rows
  at once and the session's way (each rank its own rows and sums, rank 0 the reduced per-step totals and
  the gathered sums); what it holds does not grow with the steps beyond the per-chunk aggregates (the old
  ``Telemetry.rows`` grew by n rows per step). A resume voids the redone rows of every rank's file, those
  of ranks a smaller restart no longer has included.
- ASP ``ASPLog``: the per-worker "last half" means and maxima equal a brute force over all pushes.
- ``EventRecorder``: decision events carry ``effective_step``/``predicted_s`` when the decision has them
  and work without; ``summary.json`` and ``model.pt`` are replaced atomically (no temp file left); a resumed
  recorder appends after a line the crash cut, and the run reads back as one run.

Run: ``python -m pytest -q tests/unit/test_recorder.py``
"""

from __future__ import annotations

import json
import random
from collections import deque
from statistics import fmean
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.asp.rules import Staleness
from omnilearn.asp.settings import ASPSettings
from omnilearn.balance.controllers import Decision
from omnilearn.balance.efficiency import (StepRow, balance_efficiency, by_step, ideal_step_s, measured_step_s,
                                          worker_stats)
from omnilearn.config import BalanceConfig
from omnilearn.emulation.speeds import SpeedSchedule
from omnilearn.observe.asplog import ASPLog
from omnilearn.observe.events import EventRecorder
from omnilearn.observe.modelfile import saver
from omnilearn.observe.rankrows import RankRows, Totals, partials, void_gone
from omnilearn.observe.recorder import Telemetry
from omnilearn.observe.metrics import read_metrics
from omnilearn.observe.suffix import CHUNK_RECORDS, SuffixStats
from omnilearn.runplan import RunPlan


# ------------------------------------------------------------------------------------------ SuffixStats
@settings(max_examples=150, deadline=None)
@given(records=st.lists(st.tuples(st.floats(-1e3, 1e3), st.floats(-1e3, 1e3)), min_size=1, max_size=60),
       chunk=st.integers(1, 9), first=st.integers(-3, 70))
def test_suffix_stats_equal_brute_force_for_any_suffix(records, chunk, first):
    stats = SuffixStats(("sum", "max"), chunk=chunk)
    for r in records:
        stats.add(r)
    tail = records[max(0, first):]
    total, top = stats.since(first)
    assert total == pytest.approx(sum(r[0] for r in tail), abs=1e-6)
    assert top == (max(r[1] for r in tail) if tail else -np.inf)
    k = min(max(0, first), len(records) - 1)
    assert stats.record(k) == list(records[k])
    assert stats.held_floats <= 2 * (len(records) // chunk + chunk)
    stats.close()


@settings(max_examples=100, deadline=None)
@given(records=st.lists(st.tuples(st.floats(-1e3, 1e3), st.floats(-1e3, 1e3)), min_size=1, max_size=60),
       chunk=st.integers(1, 9), cuts=st.lists(st.integers(0, 60), max_size=5))
def test_suffix_stats_extend_in_any_pieces_equals_adding_one_at_a_time(records, chunk, cuts):
    one, many = SuffixStats(("sum", "max"), chunk=chunk), SuffixStats(("sum", "max"), chunk=chunk)
    for r in records:
        one.add(r)
    bounds = [0, *sorted(min(c, len(records)) for c in cuts), len(records)]
    for a, b in zip(bounds, bounds[1:]):
        many.extend(records[a:b])  # a window's rows at once (the session's RankRows.add); empty pieces too
    assert many.count == one.count and len(many.chunk_aggregates) == len(one.chunk_aggregates)
    for first in range(len(records) + 1):
        assert many.since(first) == one.since(first)
    assert [many.record(i) for i in range(len(records))] == [one.record(i) for i in range(len(records))]
    with pytest.raises(ValueError, match="2 values each"):
        many.extend([[1.0, 2.0, 3.0]])
    one.close()
    many.close()


def test_suffix_stats_reject_bad_records():
    with pytest.raises(ValueError, match="ops"):
        SuffixStats(("mean",))
    stats = SuffixStats(("sum",))
    with pytest.raises(ValueError, match="1 values"):
        stats.add([1.0, 2.0])
    with pytest.raises(IndexError):
        stats.record(0)


# ---------------------------------------------------------------------------------------- BSP telemetry
N, B, INTERVAL = 3, 96, 7


def bsp_setup(tmp_path, quiet=True):
    cfg = BalanceConfig(workers=N, global_batch=B, speeds="4,2,1", control_interval=INTERVAL, quiet=quiet)
    run = RunPlan(steps_per_epoch=50, total_steps=None, speeds=SpeedSchedule.constant((4.0, 2.0, 1.0)), lag=0)
    return cfg, run


def synthetic_table(steps: list[int], rng: random.Random) -> list[list[list[float]]]:
    """One interval: per rank, rows ``[step, batch, compute_s, wait_s, step_s, loss, delay_s, lr]``."""
    table = [[] for _ in range(N)]
    for step in steps:
        batches = [32 + rng.randint(-20, 20), 32 + rng.randint(-20, 20)]
        batches.append(B - sum(batches))
        for rank, b in enumerate(batches):
            compute = b * 1e-4 * (rank + 1) * rng.uniform(0.8, 1.2)
            wait = rng.uniform(0, 3e-3)
            table[rank].append([step, b, compute, wait, compute + wait, rng.uniform(0.5, 2), 0.0, 0.1])
    return table


def hold(step: int) -> Decision:
    return Decision(step, (32, 32, 32), (32, 32, 32), (0.01, 0.01, 0.01), False, "held")


def run_telemetry(telemetry: Telemetry, steps: list[int], seed: int = 0) -> list[list[list[float]]]:
    """Feed ``steps`` interval by interval; every table, for the reference."""
    rng, tables = random.Random(seed), []
    telemetry.speeds(0, (4.0, 2.0, 1.0))
    for k in range(0, len(steps), INTERVAL):
        table = synthetic_table(steps[k : k + INTERVAL], rng)
        telemetry.interval(table, hold(steps[min(k + INTERVAL, len(steps)) - 1]), steps[-1] + 1)
        tables.append(table)
    return tables


def old_summary(tables: list[list[list[list[float]]]]) -> dict:
    """What the old Telemetry computed from its ``rows`` (every row of the run kept in memory)."""
    rows, train_loss = [], {}
    for table in tables:
        for rank, rs in enumerate(table):
            for step, batch, compute_s, wait_s, step_s, loss, _, _ in rs:
                rows.append(StepRow(int(step), rank, int(batch), compute_s, wait_s, step_s))
                train_loss[int(step)] = train_loss.get(int(step), 0.0) + loss * batch / B
    done = sorted(by_step(rows))
    first = done[len(done) // 2]
    last = {s.rank: s.mean_compute_s for s in worker_stats(rows, done[max(0, len(done) - INTERVAL)])}
    half = [v for s, v in by_step(rows).items() if s >= first]
    return {"steps": len(done), "stats_from_step": first, "final_train_loss": train_loss[done[-1]],
            "balance_efficiency": balance_efficiency(rows, first),
            "ideal_step_s": fmean(ideal_step_s(v) for v in half),
            "mean_step_s": fmean(measured_step_s(v) for v in half),
            "last_interval_compute_s": [last[r] for r in sorted(last)],
            "last_interval_compute_spread": max(last.values()) / min(last.values()) - 1,
            "workers": [{"rank": s.rank, "mean_batch": s.mean_batch, "mean_compute_s": s.mean_compute_s,
                         "mean_wait_s": s.mean_wait_s, "speed": s.speed} for s in worker_stats(rows, first)]}


@pytest.mark.parametrize("count", [1, 5, 300, 1001])
def test_bsp_summary_equals_the_old_formulas_and_every_row_is_written(tmp_path, count):
    steps = [s for s in range(2 * count + 10) if s % 10 != 3][:count]  # an API loop may skip steps
    cfg, run = bsp_setup(tmp_path)
    telemetry = Telemetry(cfg, run, tmp_path)
    tables = run_telemetry(telemetry, steps)
    summary = telemetry.finish(wall_s=12.0, train_s=10.0, save=saver(torch.nn.Linear(2, 2)))
    expected = old_summary(tables)
    assert telemetry.steps_recorded == len(steps) == summary["steps"]
    workers = expected.pop("workers")
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-9), key
    for got, want in zip(summary["workers"], workers, strict=True):
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-9)
    assert summary["declared_speeds"] == [4.0, 2.0, 1.0] and summary["samples_per_s"] == pytest.approx(count * B / 10)
    written = read_metrics(tmp_path, "step")
    rows = [(rank, row) for table in tables for rank, rs in enumerate(table) for row in rs]
    assert len(written) == len(rows) == count * N
    for w, (rank, row) in zip(sorted(written, key=lambda r: (r["step"], r["rank"])),
                              sorted(rows, key=lambda x: (x[1][0], x[0]))):
        assert (w["rank"], w["step"], w["batch"], w["compute_s"], w["loss"]) == (rank, row[0], row[1], row[2], row[5])
    assert len(read_metrics(tmp_path, "decision")) == len(tables)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == count
    assert torch.load(tmp_path / "model.pt", weights_only=True).keys() == {"weight", "bias"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "model.pt", "steps", "summary.json"]  # no temp
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == [f"rank-{r}.jsonl" for r in range(N)]


def held_items(obj, seen=None) -> int:
    """Elements held by ``obj``'s containers, followed through our own objects (files and consoles skipped)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))) or hasattr(obj, "fileno"):
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.size
    if isinstance(obj, dict):
        return len(obj) + sum(held_items(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set, deque)):
        return len(obj) + sum(held_items(v, seen) for v in obj)
    if type(obj).__module__.startswith("omnilearn") and hasattr(obj, "__dict__"):
        return sum(held_items(v, seen) for v in vars(obj).values())
    return 0


@pytest.mark.parametrize("count", [1, 5, 300])
def test_the_sessions_way_own_rows_and_reduced_totals_gives_the_old_summary(tmp_path, count):
    """Each rank writes its rows and keeps its sums; rank 0 sees only what two reductions and one gather bring."""
    cfg, run = bsp_setup(tmp_path)
    telemetry = Telemetry(cfg, run, tmp_path, own_rows=True)
    telemetry.speeds(0, (4.0, 2.0, 1.0))
    ranks = [RankRows(rank, run.steps_per_epoch, tmp_path) for rank in range(N)]
    rng, tables, steps = random.Random(3), [], list(range(count))
    for k in range(0, count, INTERVAL):
        table = synthetic_table(steps[k : k + INTERVAL], rng)
        parts = [partials(rows) for rows in table]
        for rank_rows, rows in zip(ranks, table):
            rank_rows.add(rows)
        summed = [sum(v) for v in zip(*(p[0] for p in parts))]  # what dist.reduce(SUM) hands rank 0
        maxed = [max(v) for v in zip(*(p[1] for p in parts))]  # and dist.reduce(MAX)
        totals = Totals.of([int(r[0]) for r in table[0]], summed, maxed, N, B)
        telemetry.window(totals, hold(table[0][-1][0]), count)
        tables.append(table)
    telemetry.worker_sums([r.summary_row(INTERVAL) for r in ranks])
    summary = telemetry.finish(wall_s=12.0, train_s=10.0)
    expected = old_summary(tables)
    workers = expected.pop("workers")
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-9), key
    for got, want in zip(summary["workers"], workers, strict=True):
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-9)
    assert len(read_metrics(tmp_path, "step")) == count * N
    assert telemetry.stats.width == 3  # rank 0 holds three numbers per step, whatever the number of ranks


def test_a_resume_voids_the_redone_rows_of_every_rank_file(tmp_path):
    def rows(rank: int, steps, lr: float) -> list[list[float]]:
        return [[s, 32 + rank, 0.01, 0.0, 0.01, 1.0, 0.0, lr] for s in steps]

    (tmp_path / "metrics.jsonl").write_text("")
    for rank in range(3):  # the first attempt: 3 ranks, steps 0-9
        first = RankRows(rank, 50, tmp_path)
        first.add(rows(rank, range(10), 1.0))
        first.close()
    void_gone(tmp_path, 2, 5)  # resumed at step 5 with 2 workers: rank 2's file ends here
    for rank in range(2):
        again = RankRows(rank, 50, tmp_path)
        again.resume(5)
        again.add(rows(rank, range(5, 12), 2.0))
        again.close()
    got = [(r["rank"], r["step"], r["lr"]) for r in read_metrics(tmp_path, "step")]
    want = [(rank, s, 1.0 if s < 5 else 2.0) for rank in range(2) for s in range(12)] + [(2, s, 1.0) for s in range(5)]
    assert sorted(got) == sorted(want)
    assert [(r["step"], r["rank"]) for r in read_metrics(tmp_path, "step")] == sorted((s, r) for r, s, _ in want)


def test_bsp_memory_does_not_grow_with_the_steps_beyond_chunk_aggregates(tmp_path):
    held = {}
    for count in (700, 7000):
        cfg, run = bsp_setup(tmp_path)
        telemetry = Telemetry(cfg, run, None)  # no run directory: still nothing kept per step
        run_telemetry(telemetry, list(range(count)))
        held[count] = held_items(telemetry)
        width = telemetry.stats.width
        assert telemetry.stats.held_floats <= (count // CHUNK_RECORDS + CHUNK_RECORDS) * width
        assert telemetry.finish(1.0, 1.0, None)["steps"] == count
    # The old Telemetry.rows grew by N rows per step (18,900 more here); now only one small vector per chunk.
    assert held[7000] - held[700] <= (7000 // CHUNK_RECORDS + 1) * width + 8


def test_decision_events_work_with_and_without_the_new_decision_fields(tmp_path):
    recorder = EventRecorder(tmp_path)
    legacy = SimpleNamespace(step=9, old=(4, 4), new=(6, 2), times_s=(0.1, 0.3), changed=True, reason="r")
    recorder.decision(legacy, effective_step=10, applied=True)
    new = Decision(19, (6, 2), (5, 3), (0.2, 0.2), True, "r", effective_step=21, predicted_s=(0.3, 0.2))
    recorder.decision(new, effective_step=new.effective_step, applied=False)
    recorder.finish({"ok": 1})
    first, second = read_metrics(tmp_path, "decision")
    assert (first["effective_step"], first["new"], first["predicted_s"], recorder.rebalances) == (10, [6, 2], None, 1)
    assert (second["effective_step"], second["new"], second["proposed"], second["predicted_s"], second["changed"]) == (
        None, [6, 2], [5, 3], [0.3, 0.2], False)


def test_telemetry_writes_effective_step_and_predicted_time_of_the_decision(tmp_path):
    cfg, run = bsp_setup(tmp_path)
    telemetry = Telemetry(cfg, run, tmp_path)
    table = synthetic_table(list(range(INTERVAL)), random.Random(1))
    telemetry.interval(table, Decision(6, (32,) * 3, (40, 32, 24), (0.1,) * 3, True, "r", 9, (0.2, 0.1)), 7)
    (d,) = read_metrics(tmp_path, "decision")
    assert (d["effective_step"], d["predicted_s"], d["new"], d["changed"]) == (9, [0.2, 0.1], [40, 32, 24], True)


# ---------------------------------------------------------------------------------------------- ASP log
def test_asp_summary_equals_brute_force_over_all_pushes(tmp_path):
    n, rng = 3, random.Random(2)
    cfg = BalanceConfig(workers=n, global_batch=96, control_interval=4, quiet=True)
    log = ASPLog(cfg, ASPSettings(), total_pushes=10_000, run_dir=tmp_path)
    staleness, pushes = Staleness(n), []
    log.speeds(0, (1.0, 1.0, 1.0))
    for version in range(1, 1500):
        worker = rng.choice([0, 0, 0, 1, 2])  # worker 0 pushes three times as often
        pulled = max(0, version - 1 - rng.randint(0, 6))
        stale = staleness.record(worker, version - 1, pulled)
        req = SimpleNamespace(batch=rng.randint(8, 64), pulled_version=pulled, cycle_s=rng.uniform(0.01, 0.05),
                              compute_s=rng.uniform(0.005, 0.02), loss=rng.uniform(0.1, 3))
        log.push(version, worker, req, stale, 0.05, version * 0.01, version / 100)
        pushes.append((worker, req, stale))
    summary = log.finish(20.0, 15.0, staleness, saver(torch.nn.Linear(1, 1)), samples_dealt=12345)
    assert summary["samples_per_s"] == pytest.approx(sum(r.batch for _, r, _ in pushes) / 15.0)
    assert summary["final_train_loss"] == pytest.approx(fmean(r.loss for _, r, _ in pushes[-n:]))
    assert summary["max_staleness_last_half"] == max(s for _, _, s in pushes[len(pushes) // 2:])
    for w in range(n):
        mine = [(r, s) for k, r, s in pushes if k == w]
        half = mine[len(mine) // 2:]
        got = summary["workers"][w]
        assert got["mean_batch"] == pytest.approx(fmean(r.batch for r, _ in half))
        assert got["mean_cycle_s"] == pytest.approx(fmean(r.cycle_s for r, _ in half))
        assert got["mean_compute_s"] == pytest.approx(fmean(r.compute_s for r, _ in half))
        assert got["max_staleness_last_half"] == max(s for _, s in half)
        assert got["updates"] == len(mine)
    assert len(read_metrics(tmp_path, "push")) == len(pushes)
    assert summary["declared_speeds"] == [1.0, 1.0, 1.0] and summary["samples_dealt"] == 12345
    assert held_items(log) < 2000  # not 1,499 pushes x 11 fields: aggregates per chunk only


def test_console_is_quiet_but_for_the_result_line(tmp_path, capsys):
    cfg, run = bsp_setup(tmp_path, quiet=True)
    telemetry = Telemetry(cfg, run, None)
    run_telemetry(telemetry, list(range(14)))
    telemetry.finish(1.0, 1.0, None)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "balance efficiency" in out


def test_a_resumed_recorder_appends_after_the_crash_and_reads_as_one_run(tmp_path, capsys):
    first = EventRecorder(tmp_path, quiet=True)
    for step in range(6):
        first.write("step", step=step, rank=0, attempt=1)
    first.flush()
    first.log.close()  # the crash: no summary; a line cut mid-write is left at the end
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"event":"step","step":6,"ra')
    second = EventRecorder(tmp_path, quiet=True)  # resumed from the checkpoint of step 4
    second.write("resume", step=4)
    for step in range(4, 8):
        second.write("step", step=step, rank=0, attempt=2)
    second.finish({"steps": 8})
    assert [(r["step"], r["attempt"]) for r in read_metrics(tmp_path, "step")] == (
        [(s, 1) for s in range(4)] + [(s, 2) for s in range(4, 8)])
    assert "ended in a line cut by a crash" in capsys.readouterr().err
