"""``examples/keras_fit.py`` (the Keras multi-worker tutorial with ``ol.fit``) through ``omnilearn launch``.

Two workers, worker 1 at half speed (``--speeds 2,1`` given to the launcher, which passes it and ``--out`` to
the script's ``omnilearn.tf.setup()``; the script's own ``--checkpoint`` puts its best weights there).
The controller is fed scripted timings in that ratio
(``runexample.scripted_timings``): the same decisions every run. Checks: samples moved to the fast worker, the
loss fell, worker 0's output is the console (progress bar, History) and it wrote the checkpoint; every worker's
History being the same is ``tests/tf/test_tf_fit.py``'s.

Run: ``python -m pytest -q tests/examples/test_keras_fit.py``
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from needs import needs

from runexample import ROOT, assert_balanced_and_learning, scripted_timings

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]


def test_keras_fit_example_launched_on_two_tf_workers_rebalances_and_learns(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **scripted_timings("2,1")}
    launch = ["launch", "--workers", "2", "--speeds", "2,1", "--out", str(out)]
    script = ["examples/keras_fit.py", "--checkpoint", str(out / "best.weights.h5")]
    done = subprocess.run([sys.executable, "-m", "omnilearn", *launch, *script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-5000:]}"
    summary = assert_balanced_and_learning(out)
    assert summary["rebalances"] >= 1 and summary["steps"] == 48
    assert "Epoch 3/3" in done.stdout and done.stdout.count("Epoch 1/3") == 1  # worker 0's progress bar alone
    said = [line for line in done.stdout.splitlines() if line.startswith("val_accuracy by epoch")]
    assert len(said) == 1 and float(said[0].rsplit(", ", 1)[-1].rstrip("%")) > 50
    assert (out / "best.weights.h5").exists() and (out / "tf-worker1.log").exists()
