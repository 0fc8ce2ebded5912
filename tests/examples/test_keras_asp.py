"""``examples/keras_asp.py`` (TensorFlow's parameter-server training, asynchronous, on OmniLearn's chief).

Two workers, worker 1 at a third of worker 0's speed (``--speeds 3,1``), the controller fed scripted timings in
that ratio (``runexample.scripted_timings``): the same decisions every run. Checks: the batches moved to the fast
worker, every push is a ``push`` record with its staleness, each worker's p50/p99/max staleness is in
``summary.json``, every sample was applied once in each epoch, and the model learned (chance is 1 in 8).

Run: ``python -m pytest -q tests/examples/test_keras_asp.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from needs import needs

from runexample import ROOT, scripted_timings

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]


def test_keras_asp_example_moves_samples_to_the_fast_worker_and_learns(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **scripted_timings("3,1")}
    done = subprocess.run([sys.executable, "examples/keras_asp.py", "--workers", "2", "--speeds", "3,1",
                           "--epochs", "3", "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-5000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["framework"] == "tensorflow" and summary["complete_epochs"] == [0, 1, 2]
    assert summary["repeated_samples"] == 0 and summary["samples_per_epoch"] == [4096] * 3
    fast, slow = summary["workers"]
    assert fast["mean_batch"] > 2 * slow["mean_batch"], (fast["mean_batch"], slow["mean_batch"])
    assert all(w["p50_staleness"] <= w["p99_staleness"] <= w["max_staleness"] for w in summary["workers"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["event"] == "push" for r in records) == summary["updates"]
    accuracy = float(done.stdout.split("validation accuracy ")[1].split("%")[0]) / 100
    assert accuracy > 0.5 and summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-3)
    assert (out / "model.weights.h5").exists() and (out / "config.toml").exists()
