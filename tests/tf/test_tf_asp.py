"""TensorFlow ASP, part one (:mod:`omnilearn.tf.asp`): real ``tf.distribute.Server`` processes, the chief in a third.

Each run is ``tests/tf/asp_chief_script.py``: one parameter server and the workers as processes of their own, the
chief (the coordinator) in the script's, a float64 MLP on 256 synthetic samples, plain SGD, 2 epochs.

- Three workers at batches 16, 32 and 48, ``max_staleness=0``: every sample of both epochs applied exactly once,
  the server's ``version`` equal to the pushes the chief applied, every variable (model and optimizer) on the
  parameter server, and every push applied above the bound was one recomputed after a refusal.
- One worker, batch 32 with ``b_ref`` 16: the final weights are those of a local replay of the same pushes in
  order, each gradient scaled by ``32 / 16`` (1e-12): the worker sends gradients, the chief applies them scaled.
- Two workers at 16 and 48, worker 1's server SIGKILLed after 5 pushes: the chief drops it and worker 0 ends the
  run; no sample is lost or repeated and no push is applied that the chief did not count (a call of worker 0
  that failed with its peer is sent again).

Not yet built (docs/tensorflow.md): the controller, ``omnilearn train --framework tensorflow --mode asp``.

Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from needs import needs

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]
SCRIPT = Path(__file__).with_name("asp_chief_script.py")


def chief(out: Path, *args: str, env: dict[str, str] | None = None) -> tuple[dict, dict]:
    out.mkdir()
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), dict(np.load(out / "weights.npz"))


def every_sample_once(summary: dict) -> None:
    assert summary["coverage"]["samples_per_epoch"] == [256, 256]
    assert summary["coverage"]["repeated_samples"] == 0 and summary["coverage"]["complete_epochs"] == [0, 1]
    assert summary["version"] == summary["applied"] == sum(summary["pushes"]) == len(summary["order"])


def test_three_workers_apply_every_sample_once_within_the_bound(tmp_path):
    summary, _ = chief(tmp_path / "run", "3", "16,32,48", "2", "0")
    every_sample_once(summary)
    assert summary["variable_devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"]
    assert not summary["dropped"]
    for worker, _, indices, _, stale, recomputed in summary["order"]:
        assert len(indices) <= (16, 32, 48)[worker]  # an epoch's last deal may be short
        assert stale == 0 or recomputed  # above max_staleness 0 only after one refusal
    assert sum(summary["staleness"]["refused"]) == sum(r for *_, r in summary["order"])


def test_one_worker_ends_with_the_weights_of_a_local_replay_of_its_scaled_gradients(tmp_path):
    summary, weights = chief(tmp_path / "run", "1", "32", "2", "none", env={"ASP_B_REF": "16"})
    every_sample_once(summary)
    sys.path.insert(0, str(SCRIPT.parent))
    import asp_chief_script as script
    import tensorflow as tf

    model = script.build()
    for v, w in zip(model.weights, [weights[f"initial{i}"] for i in range(len(model.weights))]):
        v.assign(w)
    x, y = script.data()
    lr = float(np.float32(script.LR))  # Keras keeps the rate in a float32 variable
    for _, _, indices, _, stale, _ in summary["order"]:
        assert stale == 0
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(script.loss(y[indices], model(x[indices], training=True)))
        for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            v.assign(v - lr * ((32 / 16) * g))  # the chief scales the gradient, then SGD applies its rate
    for i, v in enumerate(model.weights):
        final = weights[f"final{i}"]
        assert np.abs(v.numpy() - final).max() <= 1e-12 * max(1.0, np.abs(final).max()), v.path


def test_a_killed_worker_loses_no_sample_and_no_push_is_applied_twice(tmp_path):
    summary, _ = chief(tmp_path / "run", "2", "16,48", "2", "none", "1", "5")
    every_sample_once(summary)
    assert list(summary["dropped"]) == ["1"] and "Error" in summary["dropped"]["1"]
    assert summary["pushes"][0] > summary["pushes"][1] >= 1  # worker 0 ended the run
