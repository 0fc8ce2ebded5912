"""``omnilearn simulate`` (experiments/whatif*): the model, the run through the ControlLoop, calibration, the CLI.

Run: ``python -m pytest -q tests/unit/test_simulate.py``
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from omnilearn.balance.windows import window_row
from omnilearn.config import ConfigError
from omnilearn.experiments.simulate import whatif
from omnilearn.experiments.simulate.args import add_arguments, scenario_from_args
from omnilearn.experiments.simulate.bench import calibrate, predict
from omnilearn.experiments.simulate.model import Scenario, balanced, ring_allreduce_s
from omnilearn.experiments.simulate.run import run_all, run_controller, watched, window_rows


def args_of(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def linear(speeds, noise=0.0, steps=120, sync_s=0.0, **kw) -> Scenario:
    v = np.asarray(speeds, dtype=float)
    return Scenario(np.zeros(v.size), 1e-3 * v.max() / v, 64 * v.size, steps, tuple(v), noise=noise,
                    sync_s=sync_s, **kw)


def test_uniform_linear_workers_give_the_analytic_step_time():
    sc = linear([8, 1, 1, 1], sync_s=0.004)
    t = run_controller(sc, "uniform")
    # the slowest worker (8x slower) computes 64 samples at 8 ms per 1000: 512 ms, plus the sync
    assert np.allclose(t.step_s, 64 * 8e-3 + 0.004)
    assert t.changes == 0
    ideal_s = balanced(sc.alpha_s, sc.beta_s, np.ones(4), np.full(4, 256.0), 256)[1]
    assert ideal_s == pytest.approx(256 / (1000 + 3 * 125) * 1.0, rel=1e-6)  # B / sum(v)


@pytest.mark.parametrize("name", ["omnilearn", "model"])
def test_balancing_controllers_reach_efficiency_near_one_without_noise(name):
    v = np.array([6.0, 6, 4, 32])
    sc = Scenario(2e-3 * v.max() / v, 1e-3 * v.max() / v, 512, 150, tuple(v))  # affine: a fixed part
    rows, _, _ = run_all(sc, ["uniform", name], first=60)
    adaptive = rows[1]
    assert adaptive["balance_efficiency"] > 1 - sc.deadband  # the loop stops moving within its deadband
    assert adaptive["speedup_uniform"] > 2.0
    assert adaptive["changes"] >= 1


def test_a_2x_slowdown_is_followed():
    sc = scenario_from_args(args_of("--speeds", "4,2,1,1", "--noise", "0.03", "--change", "100:0:2.0",
                                    "--steps", "200", "--fixed-ms", "2"))
    assert sc.change_steps == (100,)
    assert sc.multiplier(99)[0] == 1.0 and sc.multiplier(100)[0] == 2.0
    rows, traces, _ = run_all(sc, ["static", "omnilearn"])
    reaction = {r["controller"]: r["reaction_steps"][0] for r in rows}
    assert reaction["omnilearn"] is not None and reaction["omnilearn"] <= 2 * sc.interval
    assert reaction["static"] is None  # a fixed plan never follows
    assert watched(sc)[0] == 0  # the worker a change hits is watched first
    assert traces[1].batches[-1, 0] < traces[1].batches[99, 0]  # worker 0 got less work


def test_every_controller_sees_the_same_draws():
    sc = linear([2, 1, 1], noise=0.2, steps=30)
    a, b = run_controller(sc, "uniform"), run_controller(sc, "uniform")
    assert np.array_equal(a.step_s, b.step_s)
    other = run_controller(dataclasses.replace(sc, seed=1), "uniform")
    assert not np.array_equal(a.step_s, other.step_s)


def test_window_rows_match_window_row_per_worker():
    rng = np.random.default_rng(0)
    plan = np.array([10, 20, 30, 40, 50])
    times = rng.uniform(0.1, 0.2, (5, 6))
    at_plan = np.ones((5, 6), dtype=bool)
    at_plan[[1, 3], :4] = False  # changed 4 steps ago
    at_plan[4] = False  # not one step at its plan yet
    rows = window_rows(plan, times, at_plan)
    expect = np.array([window_row(int(b), t[m]) for b, t, m in zip(plan, times, at_plan)])
    assert np.allclose(rows, expect)


def test_ring_allreduce_and_caps():
    assert ring_allreduce_s(4, 1e9, 8.0, 0.001) == pytest.approx(0.001 + 1.5 * 1.0)
    assert ring_allreduce_s(1, 1e9, 8.0, 0.001) == 0.0
    sc = scenario_from_args(args_of("--workers", "8", "--mix", "a100:0.5,t4:0.5", "--max-batch", "a100:80,t4:64"))
    assert sc.bounds().caps().tolist() == [80] * 4 + [64] * 4
    rows, traces, _ = run_all(dataclasses.replace(sc, steps=60), ["omnilearn"])
    assert traces[0].batches.max() <= 80


def test_many_workers_are_fast():
    sc = scenario_from_args(args_of("--workers", "2048", "--noise", "0.1", "--steps", "60", "--change", "30:0-9:2"))
    rows, _, _ = run_all(sc, ["uniform", "omnilearn"])
    assert rows[1]["speedup_uniform"] > 1.2


@pytest.mark.parametrize("argv, words", [
    (["--controllers", "uniform,fastest"], "unknown controller 'fastest'"),
    (["--workers", "8", "--mix", "a100:0.5,b200:0.5"], "unknown GPU 'b200'"),
    (["--workers", "8", "--mix", "a100"], "NAME:SHARE"),
    (["--change", "200:9:2"], "--change"),
    (["--speeds", "HL3"], "--speeds"),
    (["--global-batch", "2", "--workers", "4"], "global batch"),
    (["--workers", "20000"], "--workers"),
])
def test_bad_input_is_one_line(argv, words, capsys):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        whatif.run(args_of(*argv))
    assert whatif.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnilearn: error: ") and err.count("\n") == 1 and words in err


def write_run(path, alpha, beta, batches, steps, rng, noise=0.02, sync_s=0.005):
    path.mkdir(parents=True)
    lines = []
    for s in range(steps):
        compute = (alpha + beta * batches) * (1 + noise * rng.standard_normal(alpha.size))
        step_s = compute.max() + sync_s
        lines += [json.dumps({"event": "step", "step": s, "epoch": 0, "rank": i, "batch": int(b),
                              "compute_s": float(c), "wait_s": float(step_s - c), "step_s": float(step_s)})
                  for i, (b, c) in enumerate(zip(batches, compute))]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "config.toml").write_text("[train]\nmin_batch = 8\ndeadband = 0.05\ncontrol_interval = 15\n")


def test_calibration_recovers_alpha_beta_from_run_dirs(tmp_path, capsys):
    rng = np.random.default_rng(0)
    alpha, beta = np.array([0.010, 0.010, 0.012, 0.004]), np.array([3e-4, 3e-4, 4.5e-4, 0.6e-4])
    plans = {"uniform": np.full(4, 128), "static": np.array([64, 64, 43, 341])}
    results = []
    for arm, plan in plans.items():
        dirs = [tmp_path / f"HL8-{arm}-r{k}" for k in range(2)]
        for d in dirs:
            write_run(d, alpha, beta, plan, 100, rng)
        step = float(np.max(alpha + beta * plan)) + 0.005
        results.append({"setting": "HL8", "arm": arm, "mean_step_s": step, "speedup": None,
                        "balance_efficiency": 0.8, "figures_from_step": 50, "run_dirs": [str(d) for d in dirs]})
    (tmp_path / "bench.json").write_text(json.dumps({
        "mode": "quick", "steps": 100, "repeats": 2, "arms": ["uniform", "static", "omnilearn"],
        "settings": ["HL8"], "workers": 4, "global_batch": 512, "control_interval": 15, "results": results}))
    sc, facts = calibrate(tmp_path, "HL8")
    assert np.allclose(sc.alpha_s, alpha, rtol=0.15, atol=5e-4)
    assert np.allclose(sc.beta_s, beta, rtol=0.05)
    assert np.median(sc.sync_samples) == pytest.approx(0.005, rel=0.2)
    assert facts["arms"] == ["uniform", "static"] and sc.min_batch == 8
    rows = predict(sc, facts, seeds=2)
    assert abs(rows[0]["step_ms"]["error"]) < 0.1 and rows[1]["role"] == "calibration"
    assert whatif.main(["--from-bench", str(tmp_path), "--seeds", "2"]) == 0
    assert "calibrated on 4 uniform/static runs" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="HL1"):
        calibrate(tmp_path, "HL1")
