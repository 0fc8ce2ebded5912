"""``examples/keras_fit.py`` (the Keras multi-worker tutorial with ``ol.fit``): two workers with ``TF_CONFIG``, worker 1 at half speed.

The controller is fed scripted timings in that ratio (``runexample.scripted_timings``): the same decisions every
run. Checks: samples moved to the fast worker, the loss fell, worker 0 alone printed (progress bar, History) and
wrote the checkpoint, and both workers' History said the same.

Run: ``python -m pytest -q tests/examples/test_keras_fit.py``
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omnilearn.tf.cluster import free_ports, local_config
from runexample import EXAMPLES, ROOT, assert_balanced_and_learning, scripted_timings

pytest.importorskip("tensorflow", reason="the [tensorflow] extra is not installed")
pytestmark = pytest.mark.dist


def test_keras_fit_example_on_two_tf_workers_rebalances_and_learns(tmp_path):
    out, ports = tmp_path / "run", free_ports(2)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **scripted_timings("2,1")}
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / "keras_fit.py"), "--speeds", "2,1", "--out", str(out)],
                              env={**env, "TF_CONFIG": local_config(ports, rank)}, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-5000:]}"
    summary = assert_balanced_and_learning(out)
    assert summary["rebalances"] >= 1 and summary["steps"] == 48
    (out0, _), (out1, _) = outputs
    assert "Epoch 3/3" in out0 and "Epoch" not in out1  # the progress bar on worker 0 only
    said = [line for line in out0.splitlines() + out1.splitlines() if line.startswith("val_accuracy by epoch")]
    assert len(said) == 2 and said[0] == said[1]  # every worker's History is the same
    assert (out / "best.weights.h5").exists() and float(said[0].rsplit(", ", 1)[-1].rstrip("%")) > 50
