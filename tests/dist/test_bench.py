"""``omnilearn bench`` end to end on a tiny budget, and ``omnilearn report`` on its output.

The BSP bench: a warm-up job, two interleaved repeats (``--quick``), spread,
paired speed-ups, verdicts, settling within a control interval, ``--arms``
errors. Also ``bench --mode asp`` (uniform and omnilearn ASP arms plus an
OmniLearn BSP arm at equal training time and equal epochs) and its one-line errors.

Run: ``python -m pytest -q tests/dist/test_bench.py`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import json

import pytest

from omnilearn.experiments.cli import main

pytestmark = pytest.mark.dist


def test_bench_runs_every_arm_and_writes_json_table_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--quick", "--speeds", "HL1,paper", "--steps", "12", "--block-steps", "6",
                 "--control-interval", "3", "--global-batch", "256", "--target-accuracy", "0.05", "--out", str(out)])
    assert code == 0
    bench = json.loads((out / "bench.json").read_text())
    assert bench["repeats"] == 2 and bench["arms"] == ["uniform", "static", "model"]  # --quick: 2 repeats; model: the default controller
    assert bench["warmup_steps"] == 12 and (out / "warmup" / "summary.json").exists()  # 4 intervals, unmeasured
    arms = {(r["setting"], r["arm"]) for r in bench["results"]}
    assert arms == {("HL1", a) for a in ("uniform", "static", "model", "ddp")} | {
        ("paper", a) for a in ("uniform", "static", "model")}
    by = {(r["setting"], r["arm"]): r for r in bench["results"]}
    assert by[("HL1", "uniform")]["speedup"] == pytest.approx(1.0)
    assert by[("HL1", "ddp")]["speedup"] > 0 and by[("HL1", "ddp")]["steps"] == 12
    for r in bench["results"]:
        assert r["repeats"] == 2 and len(r["run_dirs"]) == 2
        assert len(r["spread"]["mean_step_s"]["per_repeat"]) == 2
        assert r["spread"]["mean_step_s"]["min"] <= r["mean_step_s"] <= r["spread"]["mean_step_s"]["max"]
    hl1 = by[("HL1", "model")]
    assert hl1["figures_from_step"] == 0 and hl1["step_clock"] == "wall"  # 12 steps < one epoch of 39
    assert hl1["verdict"]["vs_uniform"]["verdict"] in ("faster", "slower", "same (within spread)")
    assert len(hl1["verdict"]["vs_static"]["per_repeat"]) == 2 and "verdict" not in by[("HL1", "static")]
    paper = by[("paper", "model")]
    assert paper["steps"] == 48 and len(paper["reaction_steps"]) >= 4
    assert len(paper["settled_within_interval"]) == len(paper["speed_change_steps"])
    assert 0 < paper["balance_efficiency"] <= 1.2 and paper["efficiency_floor"] == hl1["balance_efficiency"]
    assert paper["time_to_accuracy_s"] is not None  # 5% is reached at the first evaluation
    assert "fidelity_error" in by[("HL1", "uniform")]
    table = capsys.readouterr().out
    assert "| paper | model |" in table and "| HL1 | ddp |" in table and "Mean over 2 repeats" in table
    assert "paper, model: settled within one control interval (3 steps)" in table
    for png in ("speedup.png", "efficiency.png", "paper-model-r0/batches.png", "paper-model-r1/batches.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second bench into the same directory is refused, and the first is left as it was.
    assert main(["bench", "--quick", "--speeds", "HL1", "--out", str(out)]) == 2
    assert json.loads((out / "bench.json").read_text()) == bench


@pytest.mark.parametrize("flags, match", [
    (["--arms", "uniform,fast"], "--arms names 'fast', not a controller"),
    (["--arms", "uniform,ddp"], "plain DDP runs at HL1 by itself"),
    (["--arms", "model,model"], "names a controller twice"),
    (["--arms", ","], "--arms names no controller"),
    (["--mode", "asp", "--arms", "uniform"], "--arms picks the controllers of a BSP bench"),
])
def test_bench_bad_arms_is_one_line(tmp_path, capsys, flags, match):
    assert main(["bench", "--out", str(tmp_path / "b"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnilearn: error: ") and match in err and err.count("\n") == 1
    assert not (tmp_path / "b").exists()


def test_asp_bench_runs_three_arms_at_equal_time_and_writes_json_table_and_plots(tmp_path, capsys):
    out = tmp_path / "asp"
    code = main(["bench", "--mode", "asp", "--quick", "--speeds", "HL8", "--time-budget-s", "2",
                 "--control-interval", "5", "--target-accuracy", "0.05", "--out", str(out)])
    assert code == 0
    bench = json.loads((out / "bench.json").read_text())
    assert bench["train_mode"] == "asp" and bench["time_budget_s"] == 2.0 and bench["lr_schedule"] == "constant"
    assert bench["bsp_lr"] == 0.05 and bench["bsp_momentum"] == 0.9 and bench["lr"] == 0.05  # BSP vs ASP defaults
    by = {r["arm"]: r for r in bench["results"]}
    assert [(r["setting"], r["arm"], r["levels"]) for r in bench["results"]] == [
        ("HL8", "uniform", "asp"), ("HL8", "omnilearn", "asp"), ("HL8", "bsp", "bsp")]
    for arm in ("uniform", "omnilearn"):
        r = by[arm]
        assert r["train_s"]["mean"] >= 2.0  # stopped at the budget: the first request after it (however slow the host)
        assert r["max_staleness"] >= r["mean_staleness"] >= 0 and len(r["updates_per_s_per_worker"]) == 4
        assert [sum(row) for row in r["staleness_histogram"]] == pytest.approx(
            [u * r["train_s"]["mean"] for u in r["updates_per_s_per_worker"]], abs=1)
        assert 0 <= r["accuracy_at_budget"]["mean"] <= 1 and r["accuracy_at_budget"]["per_repeat"] == [
            r["accuracy_at_budget"]["mean"]]
        assert 0 <= r["accuracy_at_budget_s"]["mean"] <= 2.0  # an ASP arm's last update is applied within the budget
        assert r["time_to_accuracy_s"]["mean"] is not None  # 5% is reached at the first evaluation
    uniform_pushes = [json.loads(line) for line in (out / "HL8-uniform" / "metrics.jsonl").read_text().splitlines()]
    assert {p["batch"] for p in uniform_pushes if p["event"] == "push"} <= set(range(1, 129))  # B/n, or an epoch's end
    assert not any(d.get("changed") for d in uniform_pushes if d["event"] == "decision")
    assert by["bsp"]["max_staleness"] == 0 and by["bsp"]["staleness_histogram"] is None
    # BSP evaluates once per epoch and at its end; on a slow host all may come after the budget: then its first one
    # stands in, its time says so, and the table marks it late (issue 32: it was None).
    assert 0 <= by["bsp"]["accuracy_at_budget"]["mean"] <= 1
    bsp_late = by["bsp"]["accuracy_at_budget_s"]["mean"] > 2.0
    epochs = by["bsp"]["equal_epochs"]  # whole epochs every arm reached, per repeat (1 repeat: --quick)
    assert len(epochs) == 1 and all(r["equal_epochs"] == epochs for r in bench["results"])
    for r in bench["results"]:
        assert (r["accuracy_at_equal_epochs"]["mean"] is None) == (epochs[0] is None)
    table = capsys.readouterr().out
    assert "| HL8 | asp | omnilearn |" in table and "| HL8 | bsp | bsp |" in table
    rows = {line.split(" | ")[2]: line for line in table.splitlines() if line.startswith("| HL8 |")}
    assert [("(late: " in rows[arm]) for arm in ("uniform", "omnilearn", "bsp")] == [False, False, bsp_late]
    assert (out / "bench.md").read_text().startswith("| setting | HL table | arm |")
    for png in ("accuracy.png", "accuracy-HL8.png", "staleness-HL8.png", "HL8-omnilearn/staleness.png",
                "HL8-uniform/batches.png", "HL8-bsp/batches.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


@pytest.mark.parametrize("flags, match", [
    (["--speeds", "HL3"], "unknown bench setting"),
    (["--speeds", "paper"], "fixed levels"),
    (["--time-budget-s", "0"], "--time-budget-s 0 must be a positive"),
    (["--time-budget-s", "-2"], "must be a positive"),
    (["--emulator", "cgroup"], "--mode asp emulates speeds with --emulator delay or none"),
    (["--block-steps", "5"], "--block-steps is for the paper routine"),
    (["--steps", "0"], "the bsp arm's steps"),
    (["--repeats", "0"], "--repeats 0 must be at least 1"),
])
def test_asp_bench_bad_input_is_one_line(tmp_path, capsys, flags, match):
    assert main(["bench", "--mode", "asp", "--out", str(tmp_path / "b"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnilearn: error: ") and match in err and err.count("\n") == 1
    assert not (tmp_path / "b").exists()


def test_time_budget_needs_asp(tmp_path, capsys):
    assert main(["bench", "--time-budget-s", "5", "--out", str(tmp_path / "b")]) == 2
    assert "--time-budget-s is only used with --mode asp" in capsys.readouterr().err
