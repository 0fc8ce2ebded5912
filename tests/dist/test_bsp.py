"""Real multi-process BSP runs (gloo on CPU) through the CLI: equivalence, run dir, emulation.

Equivalence: 1 worker and 3 heterogeneous workers end with the same weights
(relative < 1e-5), also when the 3 accumulate gradients over 2 micro-batches.

Run: ``python -m pytest -q tests/dist/test_bsp.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from omnilearn.tomlfile import loads as toml_loads
from pathlib import Path

import pytest
import torch

from cli_run import load_weights, train
from omnilearn.observe.metrics import read_metrics

pytestmark = pytest.mark.dist


def test_one_worker_and_three_heterogeneous_workers_end_with_the_same_weights(tmp_path):
    common = ["--global-batch", "256", "--max-steps", "36", "--control-interval", "6", "--seed", "3"]
    train(tmp_path / "one", "--workers", "1", "--speeds", "1", *common)
    three = train(tmp_path / "three", "--workers", "3", "--speeds", "4,2,1", *common)
    # The controller really moved batches, so the split changed during the run.
    assert three["rebalances"] >= 1
    batches = {tuple(d["new"]) for d in read_metrics(tmp_path / "three", "decision") if d["changed"]}
    assert batches and all(sum(b) == 256 for b in batches)
    a, b = load_weights(tmp_path / "one"), load_weights(tmp_path / "three")
    assert a.keys() == b.keys()
    for name in a:
        rel = (a[name] - b[name]).norm() / a[name].norm()
        assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"


def test_three_heterogeneous_workers_accumulating_end_with_one_workers_weights(tmp_path):
    # accumulation_steps through a config file: TrainConfig has every BalanceConfig field.
    (tmp_path / "accumulate.toml").write_text("[train]\naccumulation_steps = 2\n")
    common = ["--global-batch", "256", "--max-steps", "36", "--control-interval", "6", "--seed", "3"]
    train(tmp_path / "one", "--workers", "1", "--speeds", "1", *common)
    three = train(tmp_path / "three", "--config", str(tmp_path / "accumulate.toml"), "--workers", "3",
                  "--speeds", "4,2,1", *common)
    assert toml_loads((tmp_path / "three" / "config.toml").read_text())["train"]["accumulation_steps"] == 2
    assert three["rebalances"] >= 1
    a, b = load_weights(tmp_path / "one"), load_weights(tmp_path / "three")
    for name in a:
        rel = (a[name] - b[name]).norm() / a[name].norm()
        assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"


def test_run_directory_holds_config_metrics_summary_and_model(tmp_path):
    out = tmp_path / "run"
    summary = train(out, "--workers", "2", "--speeds", "2,1", "--max-steps", "24", "--control-interval", "8",
                    "--global-batch", "128")
    cfg = toml_loads((out / "config.toml").read_text())["train"]
    assert cfg["workers"] == 2 and cfg["speeds"] == "2,1" and cfg["global_batch"] == 128
    steps = read_metrics(out, "step")
    assert len(steps) == 24 * 2
    assert {"step", "epoch", "rank", "batch", "compute_s", "wait_s", "step_s", "loss", "lr"} <= steps[0].keys()
    for s in range(24):
        assert sum(r["batch"] for r in steps if r["step"] == s) == 128
    assert len(read_metrics(out, "decision")) == 3
    assert read_metrics(out, "eval")
    for key in ("steps", "wall_s", "samples_per_s", "final_train_loss", "test_accuracy", "balance_efficiency"):
        assert summary[key] is not None
    assert [w["rank"] for w in summary["workers"]] == [0, 1]
    assert 0 < summary["balance_efficiency"] <= 1.2
    state = load_weights(out)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    # The resolved config reproduces the run's settings.
    again = train(tmp_path / "again", "--config", str(out / "config.toml"))
    assert again["steps"] == summary["steps"]


def test_delay_emulation_slows_compute_and_makes_the_fast_worker_wait(tmp_path):
    out = tmp_path / "uniform"
    train(out, "--workers", "2", "--speeds", "4,1", "--controller", "uniform", "--max-steps", "30",
          "--global-batch", "256")
    rows = [r for r in read_metrics(out, "step") if r["step"] >= 5]
    compute = [sum(r["compute_s"] for r in rows if r["rank"] == k) / len(rows) * 2 for k in (0, 1)]
    wait = [sum(r["wait_s"] for r in rows if r["rank"] == k) / len(rows) * 2 for k in (0, 1)]
    # Worker 1 emulates a machine 4x slower: its compute is longer, and the fast worker waits for it. (Only
    # 2x is asserted: the fast worker's wall-clock compute also counts waits for a core on a busy host.)
    assert compute[1] > 2 * compute[0]
    assert wait[0] > 0.5 * (compute[1] - compute[0])
    assert all(r["batch"] == 128 for r in rows)


def test_paper_schedule_changes_speeds_during_the_run(tmp_path):
    out = tmp_path / "paper"
    train(out, "--speed-schedule", "paper", "--max-steps", "16", "--control-interval", "4", "--global-batch", "256")
    changes = read_metrics(out, "speeds")
    assert [c["step"] for c in changes] == [0, 2, 4, 6, 10, 12, 14]
    assert changes[3]["speeds"] == [6, 6, 4, 32]


def test_loader_worker_processes_follow_batch_changes(tmp_path):
    out = tmp_path / "loader"
    summary = train(out, "--workers", "2", "--speeds", "4,1", "--loader-workers", "1", "--max-steps", "30",
                    "--control-interval", "10", "--global-batch", "256")
    assert summary["rebalances"] >= 1


def test_torchrun_joins_the_group_unchanged(tmp_path):
    out = tmp_path / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "omnilearn", "train", "--speeds", "2,1", "--max-steps", "12", "--control-interval", "4",
           "--global-batch", "128", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and len(summary["workers"]) == 2
