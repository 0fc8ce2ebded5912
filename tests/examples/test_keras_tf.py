"""``examples/keras_tf.py`` (a Keras model on ``omnilearn.tf``): two worker processes with ``TF_CONFIG``, worker 1 at half speed.

The controller is fed scripted timings in that ratio (``runexample.scripted_timings``): the same decisions every run.

Also the Python API's one-line errors, in a process of their own (TensorFlow stays out of the test process).

Run: ``python -m pytest -q tests/examples/test_keras_tf.py``
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from needs import needs

from omnilearn.tf.cluster import free_ports, local_config
from runexample import EXAMPLES, ROOT, assert_balanced_and_learning, scripted_timings

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]


def start(rank: int, ports: list[int], *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "TF_CONFIG": local_config(ports, rank), "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.Popen([sys.executable, str(EXAMPLES / "keras_tf.py"), *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_keras_example_on_two_tf_workers_rebalances_and_learns(tmp_path):
    out, ports = tmp_path / "run", free_ports(2)
    procs = [start(rank, ports, "--speeds", "2,1", "--out", str(out), env=scripted_timings("2,1")) for rank in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-5000:]}"
    summary = assert_balanced_and_learning(out)
    assert summary["test_accuracy"] > 0.5 and summary["rebalances"] >= 1  # eight classes
    assert "epoch 3: test loss" in outputs[0][0] and outputs[1][0] == ""  # worker 0 speaks
    assert (out / "model.weights.h5").exists()


API_ERRORS = """
import numpy as np, omnilearn.tf
from omnilearn.config import ConfigError
for kw in ({"global_batch": 64, "colour": 1}, {"global_batch": 64, "local_batch": 8}, {"accumulation_steps": 2},
           {"speeds": "2,1"}):
    try:
        omnilearn.tf.setup(**kw)
    except ConfigError as e:
        print("error:", e)
ol = omnilearn.tf.setup(global_batch=64, total_steps=2)
try:
    ol.data(np.zeros((100, 3)), np.zeros(99))
except ConfigError as e:
    print("error:", e)
try:
    ol.step(np.zeros((64, 3)), np.zeros(64))
except RuntimeError as e:
    print("error:", e)
"""


def test_the_python_api_says_what_is_wrong_in_one_line():
    done = subprocess.run([sys.executable, "-c", API_ERRORS], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": ""}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert len(said) == 6, done.stdout
    for line, words in zip(said, ["unknown keyword colour=1", "local_batch=8 both given", "accumulation_steps=2",
                                  "speeds='2,1' give 2 workers but TF_CONFIG's cluster has 1",
                                  "x has 100 samples but y has 99", "needs wrap() first"]):
        assert words in line, line
